"""What the core needs to know of the agent's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bubbles.core.api import DEFAULT_CUDA_CONTEXT_MIB, FillMode, IsolationMode
from bubbles.core.identity import LOCAL_NAMESPACE

from ..guard import GuardConfig


@dataclass(frozen=True)
class CoreConfig:
    """What the core needs to know of the agent's configuration (``AgentConfig.core()`` builds it)."""

    run_dir: Path
    training: str
    # (device, CPU core or None) of the GPUs served from the start: rank 0 of stage k for the k-th (local mode); none
    # in cluster mode, where every GPU is added as its hook's card appears (``AgentCore.add_executor``).
    executors: tuple[tuple[str, int | None], ...]
    mode: FillMode = FillMode.HARVEST
    grace_s: float = 0.050
    guard: GuardConfig = field(default_factory=GuardConfig)
    isolation_mode: IsolationMode = IsolationMode.CONTEXTS
    allow_unisolated: bool = False
    # The training's limit on fill steps past a bubble's predicted end (``limits`` command; the agent's --tail-risk,
    # a PipelineTraining's spec.tailRisk). None: none sent, each fill process uses its own $BUBBLES_TAIL_RISK.
    tail_risk: float | None = None
    # An SDK job still in its init this long after its launch is killed: it holds its stage, and an init that hangs
    # (a network share, a process of another UID waiting for an MPS server) would hold it for good.
    init_timeout_s: float = 600.0
    # A job stopped by an isolation loss (or a membership check that could not be made) is started again by this
    # agent. False in cluster mode: there the process was a Pod's, which attached once; the operator starts a new
    # Pod, within the FillJob's restartLimit, once the agent reports the job stopped with its reason.
    relaunch: bool = True
    # A fill process's own CUDA context (and the libraries' modules loaded outside its allocator) on a GPU, beside
    # the allocator cap its spec's memory sets: planned on top of that memory except under MPS, where the context is
    # the server's and the pinned limit covers the client. About 0.5 GiB on recent GPUs (not measured here).
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB << 20
    # --exit-when-done: the core says when the training has ended (``.ending``); the shell then stops as on SIGTERM.
    # ``start_timeout_s``: give up (exit 1) when no stage of it has started this long after the agent's start.
    exit_when_done: bool = False
    start_timeout_s: float | None = None
    # The training's namespace (its Pod's, in cluster mode); ``_local`` for a training outside Kubernetes.
    namespace: str = LOCAL_NAMESPACE

