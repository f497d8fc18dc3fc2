"""What the core reports: events counted as they happen (``MetricsSink``), the totals the metrics endpoint exports
(``Snapshot``) and the agent's status, built from the core's state at read time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from bubbles.core.api import AgentStatus, ExecutorStatus, FillMode, FillState, GuardStatus, ModeTotals

if TYPE_CHECKING:
    from .agent import AgentCore


class MetricsSink(Protocol):
    """Where the core reports events that are counted, not derived from its state (Prometheus in the shell)."""

    def kill(self, stage: int, device: str, job: str) -> None: ...
    def rejected(self, stage: int, source: str) -> None: ...
    def missed_end(self, stage: int) -> None: ...
    def iteration(self, stage: int, seconds: float) -> None: ...
    def share(self, value: float) -> None: ...


class NullSink:
    """The do-nothing default: the core runs the same with or without a metrics endpoint."""

    def kill(self, stage: int, device: str, job: str) -> None:
        pass

    def rejected(self, stage: int, source: str) -> None:
        pass

    def missed_end(self, stage: int) -> None:
        pass

    def iteration(self, stage: int, seconds: float) -> None:
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


@dataclass(frozen=True)
class JobTotals:
    stage: int
    device: str
    mode: str
    job: str
    steps: int
    flops: float


@dataclass(frozen=True)
class IsolationTotals:
    mode: str  # contexts | mps | none
    state: str  # ready | unavailable | recovering | unisolated
    losses: int  # times working isolation was lost
    mps_restarts: int | None  # MPS control daemon restarts; None when no daemon is involved


@dataclass(frozen=True)
class Snapshot:
    """The totals the metrics endpoint exports, read at scrape time."""

    stages: list[StageTotals]
    jobs: list[JobTotals]
    job_states: list[tuple[int, str, str]]  # (stage, device, state) per job
    isolation: IsolationTotals | None = None
    baseline_s: float | None = None  # the slowdown guard's baseline iteration time (no fill work)
    budget: float = 0.0  # the slowdown the guard tolerates
    held_jobs: tuple[tuple[int, str, str], ...] = ()  # (stage, device, name) of every job record held, steps or not
    newer_messages: int = 0  # datagrams of a kind only a newer hook sends (this agent ignores them)
    late_records: int = 0  # steps and bubbles reported after their time was folded (counted against fill work)
    # (stage, device, is a client) for each stage whose training process's MPS membership is known
    training_mps_clients: tuple[tuple[int, str, bool], ...] = ()



def snapshot_of(core: AgentCore) -> Snapshot:
    """The totals the metrics endpoint exports."""
    stages: list[StageTotals] = []
    for mode, ledger in core.ledgers.items():
        for st in ledger.stages():
            t = ledger.totals(st, percentiles=False)  # under the agent's lock: no sort it does not need
            dev = core.executors[st].device if st < len(core.executors) else "cpu"
            stages.append(StageTotals(st, dev, mode, t.bubble_s, t.filled_s, t.overrun_s, t.tail_filled_s,
                                      t.tail_overrun_s))
    jobs = [JobTotals(j.stage, core.executors[j.stage].device, mode, j.name, int(v[0]), float(v[1]))
            for j in core.jobs for mode, v in j.job_totals.items()]
    states = [(j.stage, core.executors[j.stage].device, str(j.state)) for j in core.jobs]
    iso_st = core.isolation_status
    restarts = iso_st.daemon.restarts if iso_st.daemon is not None else None
    iso = IsolationTotals(str(iso_st.mode), str(iso_st.state), core.isolation_losses, restarts)
    held = tuple((j.stage, core.executors[j.stage].device, j.name) for j in core.jobs)
    clients = tuple((ex.index, ex.device, ex.training_membership.is_client) for ex in core.executors
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
    guard = GuardStatus(core.share, core.guard_stage, g.baseline_s if g else None,
                        g.slowdown_held() if g else None, tuple(g.history) if g else (),
                        g.phase if g else "harvest", tuple(g.probes.items()) if g else ())
    return AgentStatus(
        training=core.config.training, budget=core.config.guard.budget, grace_ms=core.config.grace_s * 1e3,
        guard=guard, modes=modes, isolation=core.isolation_status, isolation_losses=core.isolation_losses,
        executors=tuple(ExecutorStatus(ex.index, ex.device, ex.mode, ex.cycle is not None, ex.training_pid,
                                       ex.training_membership.wire) for ex in core.executors),
        jobs=tuple(j.status() for j in core.jobs), kills=core.kills, rejected_messages=core.rejected_messages,
        rejected_jobs=core.rejected_jobs, events=_as_dicts(core.events), steps=_as_dicts(core.steps),
        bubbles=_as_dicts(core.bubbles), ended=(core.ended.code, core.ended.reason) if core.ended else None)


def summary_of(core: AgentCore) -> str:
    """What was harvested, per stage, for a person (``bubbles agent --exit-when-done`` prints it at its end): each
    stage's bubble time and the share fill steps filled (harvest mode), its fill steps, and each fill job's steps
    against its plan."""
    head = core.ended.reason if core.ended is not None else f"training {core.config.training!r}: the agent stopped"
    lines = [f"bubbles agent: {head}"]
    ledger = core.ledgers[FillMode.HARVEST.label]
    for ex in core.executors:
        t = ledger.totals(ex.index, percentiles=False) if ex.index in ledger.stages() else None
        if t is None or t.bubble_s <= 0:
            lines.append(f"  stage {ex.index} ({ex.device}): no bubbles signalled in harvest mode")
        else:
            lines.append(f"  stage {ex.index} ({ex.device}): {t.bubble_s:.3f} s of bubbles, {t.filled_s:.3f} s filled "
                         f"({t.filled_s / t.bubble_s:.1%}), {t.fill_steps} fill steps")
        for job in core.jobs:
            if job.stage != ex.index or (job.state is FillState.STOPPED and not job.launched and not job.steps
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
