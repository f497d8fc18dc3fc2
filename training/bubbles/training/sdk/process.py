"""The fill process's main (``python -m bubbles.sdk``): load the job, create it, then serve the agent's commands.

Exit status: 0 when the job finished or was stopped, 2 for a bad command line or setting, 3 when a fill Pod's process
could not attach to (or was refused by) the node's agent; a job's own exception propagates (non-zero) once the agent
has been told what failed and where.

A gang (``$BUBBLES_GANG_SIZE`` N > 1): the agent starts each of its N processes with its ``$BUBBLES_GANG_RANK``; in a
fill Pod the one process the Pod runs has no rank, and starts the N itself, one per GPU
(``bubbles.training.sdk.gang.run_gang``), exiting with the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bubbles.core import control
from bubbles.training.sdk.attach import Attached, attach, exec_attached
from bubbles.training.sdk.checkpoint import CheckpointStore
from bubbles.training.sdk.device import apply_process_limits, check_create_left_cuda_alone, cuda_contexts
from bubbles.training.sdk.env import FillSettings
from bubbles.training.sdk.gang import GangSettings, gang_settings, gang_size, run_gang
from bubbles.training.sdk.jobs import ImperativeFillJob, IterativeFillJob, load_entry
from bubbles.training.sdk.runtime import FillRuntime, FillStopped


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bubbles.sdk", description="Run one fill job.")
    parser.add_argument("--entry", required=True, help="module:Class of the fill job")
    parser.add_argument("--args", default=os.environ.get(control.ARGS_ENV) or "{}",
                        help=f"JSON object of keyword arguments for the class (default: ${control.ARGS_ENV} or {{}})")
    return parser


def _raise_stop(signum: int, frame: object) -> None:
    raise FillStopped()


def run_fill_process(argv: Sequence[str] | None = None) -> int:
    """The fill process's main: load the job, create it, then serve the agent's commands."""
    args = list(sys.argv[1:] if argv is None else argv)
    # First in line for the kernel's OOM killer, before the training (inherited by what --exec runs).
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text(str(control.FILL_OOM_SCORE_ADJ))
    if args[:1] == ["--exec"]:
        return exec_attached(args[1:])
    ns = _parser().parse_args(args)
    try:
        if os.environ.get(control.GANG_RANK_ENV) is None and os.environ.get(control.UID_ENV) \
                and not os.environ.get(control.CONTROL_FD_ENV) and os.environ.get(control.GANG_SIZE_ENV):
            size = gang_size(os.environ[control.GANG_SIZE_ENV])
            if size > 1:  # a fill Pod's process of a gang: it starts one process per GPU, each of which attaches
                return run_gang(args, size)
        gang = gang_settings()
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    core = os.environ.get(control.CORE_ENV)
    if core:
        # Before torch starts its threads: they inherit the affinity.
        os.sched_setaffinity(0, {int(core)})
    try:
        kwargs = json.loads(ns.args)
        if not isinstance(kwargs, dict):
            raise ValueError("--args must be a JSON object")
        cls = load_entry(ns.entry)
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    fd_text = os.environ.get(control.CONTROL_FD_ENV)
    try:
        settings = FillSettings.from_environment()
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    attached: Attached | None = None
    if not fd_text and os.environ.get(control.UID_ENV):
        # In a fill Pod: the process attaches to the node's agent, which admits it or says why not.
        try:
            attached = attach(settings.device)
        except (OSError, ValueError) as exc:
            print(f"bubbles.sdk: {exc}", file=sys.stderr)
            return 3
    if issubclass(cls, ImperativeFillJob):
        return _run_imperative(cls(**kwargs), settings)
    name = os.environ.get(control.JOB_ENV, "fill")
    socket_path = os.environ.get(control.SOCKET_ENV)
    sockets: list[str] = []
    passed: dict[str, socket.socket] | None = None
    if attached is not None:
        ctrl, welcome, passed = attached.sock, attached.welcome, attached.passed
        name, socket_path = welcome["job"], welcome["socket"]
        sockets = list(welcome.get("sockets") or ())
    elif not fd_text:
        print(f"bubbles.sdk: neither ${control.CONTROL_FD_ENV} (set by a local agent that starts this process) nor "
              f"${control.UID_ENV} (set by the operator in a fill Pod, to attach to the node's agent) is set",
              file=sys.stderr)
        return 2
    else:
        ctrl = socket.socket(fileno=int(fd_text))
    return _run_iterative(cls, kwargs, ctrl, name, socket_path, settings, sockets, gang, passed)


def _run_imperative(job: ImperativeFillJob, settings: FillSettings) -> int:
    """Create, limit, init and run the job; the agent stops and continues this process around bubbles."""
    before = cuda_contexts()
    job.create()
    check_create_left_cuda_alone(settings.device, before, cuda_contexts())
    apply_process_limits(settings.device, settings.memory_bytes)
    job.init()
    job.run()
    return 0


def _run_iterative(cls: type, kwargs: dict[str, Any], ctrl: socket.socket, name: str, socket_path: str | None,
                   settings: FillSettings, sockets: list[str] | None = None, gang: GangSettings | None = None,
                   passed: dict[str, socket.socket] | None = None) -> int:
    """Create the job (restoring its checkpoint), report CREATED, serve the agent until stopped, then save the
    checkpoint; a job's exception is reported to the agent and raised again."""
    step_text = os.environ.get(control.STEP_S_ENV)
    max_steps_text = os.environ.get(control.MAX_STEPS_ENV)
    job = cls(**kwargs)
    assert isinstance(job, IterativeFillJob)
    runtime = FillRuntime(job, ctrl, name=name, socket_path=socket_path,
                          step_s=float(step_text) if step_text else None,
                          max_steps=int(max_steps_text) if max_steps_text else None,
                          device=settings.device, memory_bytes=settings.memory_bytes,
                          spin_ns=settings.spin_ns, fill_wait=settings.fill_wait, own_tail_risk=settings.tail_risk,
                          sockets=sockets, gang=gang, passed=passed)
    # SIGTERM from the agent ends the job cleanly (the socket is unlinked in serve's finally).
    signal.signal(signal.SIGTERM, _raise_stop)
    state = CheckpointStore.from_environment()
    try:
        before = cuda_contexts()
        job.create()
        if state is not None:
            state.restore(job)
        check_create_left_cuda_alone(settings.device, before, cuda_contexts())
        runtime.report_created()
        try:
            runtime.serve()
        finally:
            if state is not None:
                state.save(job)
    except FillStopped:
        runtime.disarm()
    except Exception as exc:  # report the failure to the agent, then exit non-zero
        with contextlib.suppress(FillStopped):
            runtime.report_error(_describe(exc))
        raise
    return 0


def _describe(exc: BaseException) -> str:
    """What the agent logs and the FillJob's Events show: the error and where it was raised (the fill Pod, and its
    log, may be gone by the time someone reads it)."""
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        where = tb[-1]
        text += f" (at {where.filename}:{where.lineno} in {where.name})"
    return text
