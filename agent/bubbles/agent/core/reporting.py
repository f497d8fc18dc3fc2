"""What the core reports: events counted as they happen (``MetricsSink``), the totals the metrics endpoint exports
(``Snapshot``) and the agent's status, built from the core's state at read time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from bubbles.core.api import AgentStatus, ExecutorStatus, FillMode, FillState, GuardStatus, ModeTotals
from bubbles.core.identity import GpuKey

if TYPE_CHECKING:
    from .agent import AgentCore


class MetricsSink(Protocol):
    """Where the core reports events that are counted, not derived from its state (Prometheus in the shell); each
    names the GPU (``key``) it happened on."""

    def kill(self, key: GpuKey, device: str, job: str) -> None: ...
    def rejected(self, key: GpuKey, source: str) -> None: ...
    def missed_end(self, key: GpuKey) -> None: ...
    def iteration(self, key: GpuKey, seconds: float) -> None: ...
    def share(self, value: float) -> None: ...


class NullSink:
    """The do-nothing default: the core runs the same with or without a metrics endpoint."""

    def kill(self, key: GpuKey, device: str, job: str) -> None:
        pass

    def rejected(self, key: GpuKey, source: str) -> None:
        pass

    def missed_end(self, key: GpuKey) -> None:
        pass

    def iteration(self, key: GpuKey, seconds: float) -> None:
        pass

    def share(self, value: float) -> None:
        pass

@dataclass(frozen=True)
class StageTotals:
    stage: int
    device: str
    mode: str
    bubble_s: float
    filled_s: float
    overrun_s: float
    tail_filled_s: float = 0.0  # of filled_s and overrun_s, the tail steps' (gate: tail)
    tail_overrun_s: float = 0.0
    rank: int = 0  # the GPU's rank within the stage


@dataclass(frozen=True)
class JobTotals:
    stage: int
    device: str
    mode: str
    job: str
    steps: int
    flops: float
    rank: int = 0  # the GPU's rank within the stage


@dataclass(frozen=True)
class IsolationTotals:
    mode: str  # contexts | mps | none
    state: str  # ready | unavailable | recovering | unisolated
    losses: int  # times working isolation was lost
    mps_restarts: int | None  # MPS control daemon restarts; None when no daemon is involved


@dataclass(frozen=True)
class Snapshot:
    """The totals the metrics endpoint exports, read at scrape time; one entry per GPU (stage and rank)."""

    stages: list[StageTotals]
    jobs: list[JobTotals]
    job_states: list[tuple[int, int, str, str]]  # (stage, rank, device, state) per job
    isolation: IsolationTotals | None = None
    baseline_s: float | None = None  # the slowdown guard's baseline iteration time (no fill work)
    budget: float = 0.0  # the slowdown the guard tolerates
    held_jobs: tuple[tuple[int, int, str, str], ...] = ()  # (stage, rank, device, name) of every job record held
    newer_messages: int = 0  # datagrams of a kind only a newer hook sends (this agent ignores them)
    late_records: int = 0  # steps and bubbles reported after their time was folded (counted against fill work)
    # (stage, rank, device, is a client) for each GPU whose training process's MPS membership is known
    training_mps_clients: tuple[tuple[int, int, str, bool], ...] = ()



def snapshot_of(core: AgentCore) -> Snapshot:
    """The totals the metrics endpoint exports."""
    stages: list[StageTotals] = []

    def device(key: GpuKey) -> str:
        return core.executor(key).device if core.serves(key) else "cpu"

    for mode, ledger in core.ledgers.items():
        for key in ledger.stages():
            t = ledger.totals(key, percentiles=False)  # under the agent's lock: no sort it does not need
            stages.append(StageTotals(key.stage, device(key), mode, t.bubble_s, t.filled_s, t.overrun_s,
                                      t.tail_filled_s, t.tail_overrun_s, key.rank))
    jobs = [JobTotals(j.stage, device(j.key), mode, j.name, int(v[0]), float(v[1]), j.rank)
            for j in core.jobs for mode, v in j.job_totals.items()]
    states = [(j.stage, j.rank, device(j.key), str(j.state)) for j in core.jobs]
    iso_st = core.isolation_status
    restarts = iso_st.daemon.restarts if iso_st.daemon is not None else None
    iso = IsolationTotals(str(iso_st.mode), str(iso_st.state), core.isolation_losses, restarts)
    held = tuple((j.stage, j.rank, device(j.key), j.name) for j in core.jobs)
    clients = tuple((ex.stage, ex.rank, ex.device, ex.training_membership.is_client) for ex in core.executors
                    if ex.training_membership.known)
    return Snapshot(stages, jobs, states, iso, core.guard.baseline_s if core.guard else None,
                    core.config.guard.budget, held, core.newer_messages,
                    sum(ledger.late() for ledger in core.ledgers.values()), clients)


def status_of(core: AgentCore) -> AgentStatus:
    """Everything the agent reports, typed (its ``to_dict()`` is the stats file's JSON)."""
    modes = {}
    for mode, ledger in core.ledgers.items():
        t = ledger.totals()
        modes[mode] = ModeTotals(t.fill_steps, t.fill_flops, t.bubble_s, t.filled_s, t.overruns, t.overrun_s,
                                 t.overrun_p99_ms, t.max_overrun_ms)
    g = core.guard
    guard = GuardStatus(core.share, core.guard_key.stage if core.guard_key else None, g.baseline_s if g else None,
                        g.slowdown_held() if g else None, tuple(g.history) if g else (),
                        g.phase if g else "harvest", tuple(g.probes.items()) if g else ())
    return AgentStatus(
        training=core.config.training, budget=core.config.guard.budget, grace_ms=core.config.grace_s * 1e3,
        guard=guard, modes=modes, isolation=core.isolation_status, isolation_losses=core.isolation_losses,
        executors=tuple(ExecutorStatus(ex.stage, ex.device, ex.mode, ex.cycle is not None, ex.training_pid,
                                       ex.training_membership.wire) for ex in core.executors),
        jobs=tuple(j.status() for j in core.jobs), kills=core.kills, rejected_messages=core.rejected_messages,
        rejected_jobs=core.rejected_jobs, events=_as_dicts(core.events), steps=_as_dicts(core.steps),
        bubbles=_as_dicts(core.bubbles), ended=(core.ended.code, core.ended.reason) if core.ended else None)


def summary_of(core: AgentCore) -> str:
    """What was harvested, per GPU, for a person (``bubbles agent --exit-when-done`` prints it at its end): each
    GPU's bubble time and the share fill steps filled (harvest mode), its fill steps, and each fill job's steps
    against its plan."""
    head = core.ended.reason if core.ended is not None else f"training {core.config.training!r}: the agent stopped"
    lines = [f"bubbles agent: {head}"]
    ledger = core.ledgers[FillMode.HARVEST.label]
    ranked = any(ex.rank for ex in core.executors)  # "stage k" alone where each stage has one GPU here
    for ex in core.executors:
        t = ledger.totals(ex.key, percentiles=False) if ex.key in ledger.stages() else None
        where = f"stage {ex.stage} rank {ex.rank}" if ranked else f"stage {ex.stage}"
        if t is None or t.bubble_s <= 0:
            lines.append(f"  {where} ({ex.device}): no bubbles signalled in harvest mode")
        else:
            lines.append(f"  {where} ({ex.device}): {t.bubble_s:.3f} s of bubbles, {t.filled_s:.3f} s filled "
                         f"({t.filled_s / t.bubble_s:.1%}), {t.fill_steps} fill steps")
        for job in core.jobs:
            if job.key != ex.key or (job.state is FillState.STOPPED and not job.launched and not job.steps
                                         and job.reason.startswith("cancelled")):
                continue
            st = job.status()
            rate = ""
            if st.ran_steps_per_iteration is not None and st.plan_steps_per_iteration is not None:
                rate = (f", {st.ran_steps_per_iteration:.2f} per iteration (planned "
                        f"{st.plan_steps_per_iteration:.2f}{': ' + st.plan_reason if st.plan_reason else ''})")
            lines.append(f"    job {job.name}: {job.steps} steps{rate}; {job.state}: {job.reason or 'no reason given'}")
    return "\n".join(lines)


def _as_dicts(records: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Typed records as the status's plain dicts: they are dicts already, so nothing is copied per record."""
    return cast(tuple[dict[str, Any], ...], tuple(records))
