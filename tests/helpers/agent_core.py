"""Set-ups of the agent core's tests (tests/test_agent_core*.py): a fake clock and metrics sink, a core with its
stages served, jobs submitted, launched and armed by plain calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bubbles.agent.core import AgentCore, CoreConfig, HookFacts, JobRecord, Launch
from bubbles.core import control, wire
from bubbles.core.api import IsolationMode, IsolationState, IsolationStatus, parse_spec
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey

MS = 1_000_000
READY = IsolationStatus(IsolationMode.CONTEXTS, IsolationState.READY, "ready for tests", epoch=1)


def gpu(stage: int, rank: int = 0) -> GpuKey:
    """The key of a GPU of the training ``make_core`` serves ("t", outside Kubernetes)."""
    return GpuKey(LOCAL_NAMESPACE, "t", stage, rank)


def facts(*per_stage: HookFacts) -> dict[GpuKey, HookFacts]:
    """What the shell found of rank 0 of each stage's hook, in stage order (``AgentCore.watch_hooks``)."""
    return {gpu(k): f for k, f in enumerate(per_stage)}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def __call__(self) -> int:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def kill(self, key: GpuKey, device: str, job: str) -> None:
        self.calls.append(("kill", key, device, job))

    def rejected(self, key: GpuKey, source: str) -> None:
        self.calls.append(("rejected", key, source))

    def missed_end(self, key: GpuKey) -> None:
        self.calls.append(("missed_end", key))

    def iteration(self, key: GpuKey, seconds: float) -> None:
        self.calls.append(("iteration", key, seconds))

    def share(self, value: float) -> None:
        self.calls.append(("share", value))


def cycle(stage: int = 0, slots: tuple[tuple[float, int], ...] = ((0.005, 1 << 30),),
          iteration_s: float = 0.05, stages: int = 2) -> dict[str, Any]:
    return {
        "training": "t", "stage": stage, "stages": stages, "microbatches": 4, "schedule": "TrainSchedule",
        "iteration_s": iteration_s, "samples": 5,
        "slots": [{"slot": i, "position": i, "instruction": "RecvGrad", "kind": "steady", "duration_s": d,
                   "p10_s": d, "p90_s": d, "free_bytes": free} for i, (d, free) in enumerate(slots)],
    }


def make_core(executors: int = 1, **kw: Any) -> tuple[AgentCore, Clock, Sink]:
    clock, sink = Clock(), Sink()
    cfg = CoreConfig(run_dir=Path("/run/x"), training="t", executors=tuple(("cpu", None) for _ in range(executors)),
                     **kw)
    core = AgentCore(cfg, clock, sink)
    core.on_isolation(READY)
    core.start_serving()
    return core, clock, sink


def job_spec(name: str = "j", **fields: Any) -> Any:
    return parse_spec({"name": name, "entry": "pkg.mod:Job", "memory": "16Mi", "step_time": "1ms", **fields})


def started(core: AgentCore, name: str = "j", has_control: bool = True, **fields: Any) -> JobRecord:
    """Submit to stage 0, profile it, launch: the job is CREATED (SDK) or PAUSED (plain command)."""
    job = core.submit(job_spec(name, **{"stage": 0, **fields}))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    actions = core.take_actions()
    assert [type(a) for a in actions] == [Launch] and actions[0].job is job and actions[0].isolated
    core.launched(job, has_control=has_control)
    return job


def line(type_: str, **fields: Any) -> bytes:
    return control.encode(type_, **fields).rstrip(b"\n")


def armed(core: AgentCore, **fields: Any) -> JobRecord:
    job = started(core, **fields)
    core.on_control_line(job, line("state", state="PAUSED"))
    return job
