"""How Pods reach the node agent and the GPUs, the Kubernetes way: names the agent (its CSI node plugin and device
plugin) and the operator (the fill Pods it builds, the training Pods it documents) must agree on. Defined once here.

- **Sockets**: a CSI ephemeral inline volume of driver ``CSI_DRIVER``, ``volumeAttributes: {role: training}`` in a
  training's Pod, ``{role: fill}`` in the fill Pods the operator makes. The kubelet names the Pod to the agent on
  each publish (``podInfoOnMount``), and each Pod gets a directory of its own on the node, mounted at
  ``paths.MOUNTED_RUN_DIR`` in the Pod: a training's hook writes its ``<namespace>/<training>/stage-<k>/rank-<r>/``
  tree there; a fill Pod finds its own attach socket at ``_attach/attach.sock`` (the node layout's place) and, where
  the node runs MPS, the MPS server's pipe and shared-memory directories at ``POD_MPS_PIPE_SUBDIR`` and
  ``POD_MPS_SHM_SUBDIR``.
- **GPUs**: one extended resource per GPU of a node (``resource_name(index)``), served by the agent's device plugin;
  a fill Pod requests its GPU's resource (one per GPU of a gang), and the kubelet gives it exactly that GPU.

``NodeAccess`` says which way an installation works (the chart's ``nodeAccess``); ``GpuAccess`` how fill Pods get
their GPUs (``operator.fillGpuAccess``): only ``envvar``, chosen by name, uses ``NVIDIA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import enum

CSI_DRIVER = "csi.bubbles.dev"
ROLE_KEY = "role"  # the one volumeAttribute a Pod sets


class Role(enum.StrEnum):
    """Which kind of Pod a ``CSI_DRIVER`` volume serves."""

    TRAINING = "training"
    FILL = "fill"


# In a fill Pod's volume, where the node's MPS server is (bind mounts the agent makes when it publishes the volume):
# CUDA_MPS_PIPE_DIRECTORY points at the first; the second is mounted at /dev/shm (a subPath of the same volume).
POD_MPS_PIPE_SUBDIR = "mps/pipe"
POD_MPS_SHM_SUBDIR = "mps/shm"

RESOURCE_DOMAIN = "bubbles.dev"


def resource_name(index: int) -> str:
    """The extended resource that is GPU ``index`` (its NVML index) of a node."""
    return f"{RESOURCE_DOMAIN}/gpu-{index}"


class NodeAccess(enum.StrEnum):
    """How training and fill Pods reach the node agent's sockets."""

    CSI = "csi"  # a CSI inline volume per Pod: no hostPath, any UID (Pod Security baseline and restricted)
    HOST_PATH = "hostPath"  # the node's run directory as a hostPath, as the agent's UID (Pod Security privileged)


class GpuAccess(enum.StrEnum):
    """How a fill Pod gets the training's GPU(s)."""

    DEVICE_PLUGIN = "devicePlugin"  # requests the GPU's resource (resource_name): the kubelet applies it
    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES=<UUID>: only where the NVIDIA runtime honours it from unprivileged Pods
