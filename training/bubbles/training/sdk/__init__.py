"""The fill-job SDK: the interfaces a fill job is written against, and the runtime that gates it by bubbles.

A fill job imports its part through the public face ``bubbles.sdk`` (``jobs``: ``IterativeFillJob``,
``ImperativeFillJob``, ``StepResult``, ``assigned_device``). The rest runs the fill process
(``python -m bubbles.sdk --entry module:Class [--args JSON]``, ``process``): its settings from the environment
(``env``), attaching a fill Pod's process to the node's agent (``attach``), the device (``device``: waiting for a
step's GPU work, memory caps), the job's checkpoint (``checkpoint``), the profile of its steps at init
(``profiling``) and the runtime that serves the agent's commands and runs steps inside bubbles (``runtime``). While
armed in harvest mode the runtime binds ``fills/fill-<job>.sock`` in the stage directory, where the training's hook
sends each BUBBLE_START/BUBBLE_END straight to it (one hop).

Depends only on the pure core and ``bubbles.training``'s gates and probes; torch is imported lazily (and only if
installed).
"""

from bubbles.training.sdk.attach import attach_to_agent, exec_attached
from bubbles.training.sdk.checkpoint import CheckpointStore
from bubbles.training.sdk.device import (
    DEFAULT_FILL_WAIT,
    FILL_WAITS,
    CudaDeviceSync,
    DeviceSync,
    apply_process_limits,
    check_create_left_cuda_alone,
    cuda_contexts,
    device_sync_for,
    fill_wait,
)
from bubbles.training.sdk.env import FillSettings, spin_window_ns, tail_risk
from bubbles.training.sdk.jobs import ImperativeFillJob, IterativeFillJob, StepResult, assigned_device, load_entry
from bubbles.training.sdk.process import run_fill_process
from bubbles.training.sdk.profiling import INIT_PROFILE_STEPS, INIT_PROFILE_WARMUP, PROFILE_MARGIN, check_step_sizes
from bubbles.training.sdk.runtime import STARVED_BUBBLES, FillRuntime, FillStopped

__all__ = [
    "DEFAULT_FILL_WAIT",
    "FILL_WAITS",
    "INIT_PROFILE_STEPS",
    "INIT_PROFILE_WARMUP",
    "PROFILE_MARGIN",
    "STARVED_BUBBLES",
    "CheckpointStore",
    "CudaDeviceSync",
    "DeviceSync",
    "FillRuntime",
    "FillSettings",
    "FillStopped",
    "ImperativeFillJob",
    "IterativeFillJob",
    "StepResult",
    "apply_process_limits",
    "assigned_device",
    "attach_to_agent",
    "check_create_left_cuda_alone",
    "check_step_sizes",
    "cuda_contexts",
    "device_sync_for",
    "exec_attached",
    "fill_wait",
    "load_entry",
    "run_fill_process",
    "spin_window_ns",
    "tail_risk",
]
