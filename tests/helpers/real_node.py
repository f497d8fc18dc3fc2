"""A real single-node Kubernetes cluster for the ``cluster`` tier: started and stopped by tools/node-from-debian.sh
(kubelet, containerd and runc from Debian's packages), with the project's images built by images/build.sh on
local bases (tools/image-base.sh) and imported into the node. Nothing here plays a part: the kubelet runs the Pods.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "node-from-debian.sh"
T = TypeVar("T")


class ClusterUnavailable(Exception):
    """The tier cannot run here (the message says why and what to do)."""


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
         input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, input=input_text,
                          cwd=ROOT)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _hold(path: Path, wait_s: float = 2700.0) -> int:
    """An exclusive lock on ``path`` (a descriptor; closing it, or the process ending, lets go): two test runs on one
    machine would share the node's directory, ports and bridge. Waits up to ``wait_s`` for a run holding it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(f"another test run has held {path} for {wait_s:g} s (its node is up): wait for it, "
                                   "or stop it (tools/node-from-debian.sh down)") from None
            if not said:
                print(f"another test run holds {path} (its node is up): waiting for it to finish")
                said = True
            time.sleep(5)


class RealNode:
    """The node and its API server, driven as a user would: kubectl with the admin's kubeconfig."""

    def __init__(self, state: Path, kubeconfig: Path, up_s: float) -> None:
        self.state, self.kubeconfig, self.up_s = state, kubeconfig, up_s
        self.lock: int | None = None  # held while this run's node is up (see _hold)
        config = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "config", "view", "-o",
                                 "jsonpath={.clusters[0].cluster.server}"], capture_output=True, text=True,
                                check=True).stdout
        host_port = config.removeprefix("https://")
        self.api_host, _, port = host_port.rpartition(":")
        self.api_port = int(port)
        self.name = os.environ.get("BUBBLES_NODE_NAME", "bubbles-node")

    @staticmethod
    def can_run_here() -> None:
        """The checks ``up`` makes before anything slow: raises ClusterUnavailable, saying why, where no node can."""
        if os.geteuid() != 0:
            raise ClusterUnavailable("needs root (containerd, the kubelet and their mounts)")
        if not shutil.which("apt-get") and not shutil.which("containerd"):
            raise ClusterUnavailable("no containerd and no apt-get to install it")

    @classmethod
    def up(cls, state: Path) -> RealNode:
        cls.can_run_here()
        env = {**os.environ, "BUBBLES_NODE_DIR": str(state)}
        t0 = time.monotonic()
        lock = _hold(Path(f"{state}.lock"))  # another run's live node in the same directory: wait for it to finish
        if state.exists():
            # A node an earlier run left behind (killed before its teardown, or kept with BUBBLES_NODE_KEEP=1):
            # its etcd still holds that run's namespaces, releases and jobs. The tier starts from an empty cluster.
            print(f"a node from an earlier run is left in {state}: taking it down first")
            left = _run([str(TOOL), "down"], timeout=300, env=env)
            if left.returncode != 0 or state.exists():
                # Not a skip: the machine can run the tier, an earlier run's leftovers are in the way.
                raise RuntimeError(f"could not take down the node left in {state} (tools/node-from-debian.sh down; "
                                   f"then remove {state}):\n{tail(left.stderr)}")
        try:
            cls.share_kubelet_dir(state)
        except ClusterUnavailable:
            _run([str(TOOL), "down"], timeout=300, env=env)
            os.close(lock)
            raise
        result = _run([str(TOOL), "up"], timeout=2400, env=env)
        if result.returncode != 0:
            _run([str(TOOL), "down"], timeout=300, env=env)
            os.close(lock)
            raise ClusterUnavailable(f"tools/node-from-debian.sh up failed:\n{tail(result.stderr)}")
        node = cls(state, Path(result.stdout.strip().splitlines()[-1]), time.monotonic() - t0)
        node.lock = lock
        return node

    @staticmethod
    def share_kubelet_dir(state: Path) -> None:
        """Make the kubelet's --root-dir (``<state>/kubelet``) a shared mount, as systemd makes every mount on a
        real node: containerd refuses a ``mountPropagation: Bidirectional`` volume (the agent's, with CSI) on a
        private one, and this machine's / is private. A bind mount of the directory on itself, made before the
        kubelet starts; tools/node-from-debian.sh down unmounts it with everything else under ``state``."""
        kubelet = state / "kubelet"
        kubelet.mkdir(parents=True, exist_ok=True)
        for args in (["--bind", str(kubelet), str(kubelet)], ["--make-rshared", str(kubelet)]):
            r = _run(["mount", *args], timeout=30)
            if r.returncode != 0:
                raise ClusterUnavailable(f"mount {' '.join(args)} failed: {r.stderr.strip()}")

    def down(self) -> subprocess.CompletedProcess[str]:
        try:
            return _run([str(TOOL), "down"], timeout=300, env={**os.environ, "BUBBLES_NODE_DIR": str(self.state)})
        finally:
            if self.lock is not None:
                os.close(self.lock)  # the lock goes with the descriptor
                self.lock = None

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = _run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], timeout=timeout,
                      input_text=input_text)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                "items": list(objects)}))

    def import_images(self, *images: str) -> None:
        result = _run([str(TOOL), "import", *images], timeout=900,
                      env={**os.environ, "BUBBLES_NODE_DIR": str(self.state)})
        if result.returncode != 0:
            raise AssertionError(f"importing {images} failed: {tail(result.stderr)}")

    def dump(self) -> str:
        """What a person debugging a red run wants first: the cluster's objects, Events, the bubbles Pods' logs
        and the node's daemons."""
        out = []
        for args in (["get", "nodes,pods,daemonsets,deployments", "-A", "-o", "wide"],
                     ["get", "pipelinetrainings,filljobs", "-A", "-o", "wide"],
                     ["get", "filljobs", "-A", "-o", "yaml"],
                     ["get", "events", "-A", "--sort-by", ".lastTimestamp"]):
            r = self.kubectl(*args, check=False, timeout=30)
            out.append(f"$ kubectl {' '.join(args)}\n{r.stdout}{r.stderr}")
        pods = self.kubectl("get", "pods", "-A", "-o", "json", check=False, timeout=30)
        try:
            items = json.loads(pods.stdout)["items"]
        except (ValueError, KeyError):
            items = []
        for pod in items:
            meta = pod["metadata"]
            for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
                r = self.kubectl("logs", "-n", meta["namespace"], meta["name"], "-c", c["name"], "--tail", "60",
                                 check=False, timeout=30)
                out.append(f"$ kubectl logs -n {meta['namespace']} {meta['name']} -c {c['name']}\n"
                           f"{r.stdout}{r.stderr}")
        r = _run([str(TOOL), "logs", "kubelet", "containerd"], timeout=30,
                 env={**os.environ, "BUBBLES_NODE_DIR": str(self.state)})
        out.append(r.stdout)
        return "\n".join(out)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = probe()
        except AssertionError as exc:  # a kubectl that failed: say it if time runs out
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last})" if last else ""))
        time.sleep(interval)


IMAGE_TAG = "suite"  # the tag the suite builds the images under (build_image), and the chart is installed with
PROJECT_IMAGES = ("bubbles-operator", "bubbles-agent", "bubbles-fill-job")  # images/*/Dockerfile's image titles


def prune_replaced_images(env: dict[str, str] | None = None) -> None:
    """Remove the project's images that a newer build under the same tag left untagged. Every run of the suite
    builds its images again (about 2.4 GB under buildah's vfs driver), and each build leaves the one it replaced
    behind, nameless: run after run they filled buildah's storage (15 GB on the project's VM before this). Only
    images carrying one of the project's image titles are touched; a build container still using one keeps it."""
    env = env or {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs")}
    for title in PROJECT_IMAGES:
        found = _run(["buildah", "images", "-q", "--filter", "dangling=true", "--filter",
                      f"label=org.opencontainers.image.title={title}"], timeout=120, env=env)
        ids = sorted(set(found.stdout.split())) if found.returncode == 0 else []
        if ids:
            _run(["buildah", "rmi", *ids], timeout=300, env=env)


def _image_env() -> dict[str, str]:
    return {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs"), "OFFLINE": "1"}


@functools.cache
def image_base(kind: str) -> str:
    """The local base image (tools/image-base.sh; cached on the machine): "plain" (Debian's Python) or "torch" (plus
    torch and DeepSpeed: what a user's PyTorch image brings). $BUBBLES_IMAGE_BASE, where set (make test sets it from
    the same script), names the plain one."""
    if kind == "plain" and os.environ.get("BUBBLES_IMAGE_BASE"):
        return os.environ["BUBBLES_IMAGE_BASE"]
    r = _run([str(ROOT / "tools" / "image-base.sh"), *(["--torch"] if kind == "torch" else [])], timeout=1800,
             env=_image_env())
    if r.returncode != 0:
        raise ClusterUnavailable(f"tools/image-base.sh {kind} failed:\n{tail(r.stderr)}")
    return r.stdout.strip().splitlines()[-1]


@functools.cache
def build_image(what: str) -> str:
    """``images/build.sh WHAT`` (operator and agent on the plain base, fill-job on the torch one), once per test
    session: the image tier and the cluster tier test the same build of the tree."""
    base = image_base("torch" if what == "fill-job" else "plain")
    image = f"localhost/bubbles-{what}:{IMAGE_TAG}"
    env = _image_env()
    r = _run([str(ROOT / "images" / "build.sh"), what, image], timeout=1800, env={**env, "BASE": base})
    if r.returncode != 0:
        raise AssertionError(f"images/build.sh {what} failed:\n{tail(r.stdout)}\n{tail(r.stderr)}")
    prune_replaced_images(env)
    return image


def build_images() -> dict[str, str]:
    """The three images, each from its own Dockerfile (``build_image``)."""
    return {what: build_image(what) for what in ("operator", "agent", "fill-job")}
