"""The fast simulator against the step-by-step one it replaced: the same trace, the same decisions, float for float.

Issue 37 (part 2) made the generator work on columns and the engine skip the scheduler's queue for a job that starts
at once. Each is held here to a reference kept in this file: the generator's loop over jobs and the engine's loop that
sends every job through the scheduler's queue and asks the policy at every freed executor, as both were at commit
9eefdf9 (the only changes: the reference engine calls ``submit(place=False)`` and ``fill`` where the old ``submit``
did both inside the scheduler, and ``choose`` before ``fill`` where the old ``release`` did). Two fingerprints recorded
from runs of that commit's code close the loop on the whole path the command line takes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.core.api import WorkloadKind
from bubbles.operator.scheduler import FillJobRequest, FillProfile, Scheduler, get_policy
from bubbles.operator.scheduler.core import ExecutorClass, Placement
from bubbles.operator.scheduler.gang import GangGroup, GangPlacement, fits_somewhere, place_gang
from bubbles.operator.scheduler.policies import FunctionPolicy, JobInfo, Policy, SchedulerState
from bubbles.operator.simulator import MainJob, load_profiles, read_alibaba, simulate
from bubbles.operator.simulator.engine import JobOutcome, SimResult
from bubbles.operator.simulator.trace import (
    MODEL_MIX,
    TRAINING_MAX_PARAMS,
    AlibabaTask,
    TaskColumns,
    TraceJob,
    generate_table,
    generate_trace,
    load_trace_model,
    with_gangs,
)

FIXTURE = Path(__file__).parent / "fixtures" / "alibaba-excerpt.csv"
PROFILES = load_profiles()
POLICIES = ["fifo", "sjf", "makespan", "deadline", "0.5*sjf+0.5*deadline", "0.7*deadline+0.3*fifo"]


@pytest.fixture(scope="module")
def alibaba_tasks() -> list[AlibabaTask]:
    return read_alibaba(FIXTURE)[0]


# ---- the references: the code as it was -----------------------------------------------------------------------


def reference_model_tasks(n: int, seed: int) -> list[AlibabaTask]:
    """TraceModel.tasks as it was: one AlibabaTask per sampled (gap, size)."""
    m = load_trace_model()
    rng = np.random.default_rng(seed)
    grid = np.linspace(0, 1, len(m.gap_s_quantiles))
    gaps = np.interp(rng.random(n), grid, m.gap_s_quantiles)
    grid = np.linspace(0, 1, len(m.gpu_hours_quantiles))
    sizes = np.interp(rng.random(n), grid, m.gpu_hours_quantiles)
    arrivals = np.cumsum(gaps)
    return [AlibabaTask(f"model-{i:05d}", float(a), float(h)) for i, (a, h) in enumerate(zip(arrivals, sizes,
                                                                                               strict=True))]


def reference_generate_trace(
    tasks: Sequence[AlibabaTask],
    profiles: Mapping[tuple[str, WorkloadKind], FillProfile],
    *,
    jobs: int,
    hours: float,
    seed: int = 0,
    deadline_share: float = 0.0,
    deadline_slack: float = 10.0,
    setup_s: float = 0.0,
    mix: Sequence[tuple[str, int, float]] = MODEL_MIX,
) -> list[TraceJob]:
    """generate_trace as it was: a loop over jobs (its checks left out)."""
    usable = sorted((t for t in tasks if t.gpu_hours > 0), key=lambda t: t.arrival_s)
    rng = np.random.default_rng(seed)
    arrivals = np.array([t.arrival_s for t in usable])
    gaps = np.diff(arrivals, prepend=arrivals[0])
    gaps[0] = float(np.median(gaps[1:]))
    sizes = np.array([t.gpu_hours for t in usable])
    order = np.argsort(sizes, kind="stable")
    quantile = np.empty(len(sizes))
    quantile[order] = (np.arange(len(sizes)) + 0.5) / len(sizes)
    probs = np.array([w for _, _, w in mix], dtype=float)
    edges = np.cumsum(probs / probs.sum())
    bucket = np.minimum(np.searchsorted(edges, quantile), len(mix) - 1)
    pick = rng.integers(0, len(usable), size=jobs)
    g = gaps[pick]
    total = float(g.sum()) or 1.0
    arrival_s = np.cumsum(g) * (hours * 3600.0 / total) - g[0] * (hours * 3600.0 / total)
    coin = rng.random(jobs)
    dl = rng.random(jobs)
    out: list[TraceJob] = []
    for n in range(jobs):
        k = int(pick[n])
        model, params, _ = mix[int(bucket[k])]
        kind = (WorkloadKind.TRAINING if params < TRAINING_MAX_PARAMS and coin[n] < 0.5
                else WorkloadKind.BATCH_INFERENCE)
        prof = profiles.get((model, kind)) or profiles[(model, WorkloadKind.BATCH_INFERENCE)]
        kind = prof.kind
        work_s = float(sizes[k]) * 3600.0
        samples = max(1, round(work_s * prof.isolated_samples_per_s))
        deadline = float(arrival_s[n]) + deadline_slack * work_s + setup_s if dl[n] < deadline_share else None
        out.append(TraceJob(f"job-{n:06d}", float(arrival_s[n]), model, kind, samples, deadline))
    return out


def reference_simulate(main: MainJob, jobs: Sequence[FillJobRequest], policy: str | Policy = "fifo", *,
                       hours: float | None = None, classes: Sequence[ExecutorClass] | None = None) -> SimResult:
    """engine.simulate as it was, every job through the scheduler's queue and every freed executor through a decision
    of the policy (its progress reports left out)."""
    sched = Scheduler(classes if classes is not None else main.executor_classes(), policy)
    groups, first = [], 0
    for c in sched.classes:
        groups.append(GangGroup(c.name, tuple(range(first, first + c.executors))))
        first += c.executors
    waiting: list[FillJobRequest] = []
    gang_on: dict[int, GangPlacement] = {}
    order = sorted(range(len(jobs)), key=lambda k: (jobs[k].arrival_s, k))
    horizon_s = math.inf if hours is None else hours * 3600.0
    outcomes = {j.job_id: JobOutcome(j) for j in jobs}
    assert len(outcomes) == len(jobs)
    completions: list[tuple[float, int, int]] = []
    seq = events = nxt = 0

    def submit(job: FillJobRequest, now: float) -> Placement | None:
        """The old Scheduler.submit: queued, then taken from the queue onto the idle class where it runs fastest (the
        policy, asked for that executor, must choose it: no other queued job fits an idle executor)."""
        sched.submit(job, now, place=False)
        proc = sched.processing_times_s(job)
        best_c = -1
        for c, idle in enumerate(sched._idle):
            if idle and math.isfinite(proc[c]) and (best_c < 0 or proc[c] < proc[best_c]):
                best_c = c
        if best_c < 0:
            return None
        p = sched.fill(sched._idle[best_c][-1], now)
        assert p is not None and p.job is job
        return p

    def release(e: int, now: float) -> Placement | None:
        """The old Scheduler.release(fill=True): a decision for the freed executor, whatever the queue holds."""
        sched.release(e, now, fill=False)
        return None if sched.choose(e, now) is None else sched.fill(e, now)

    def started(p: Placement | None) -> None:
        nonlocal seq
        if p is None:
            return
        outcomes[p.job.job_id].placement = p
        heapq.heappush(completions, (p.end_s, seq, p.executor))
        seq += 1

    def gang_started(g: GangPlacement) -> None:
        nonlocal seq
        outcomes[g.job.job_id].placement = g
        for e in g.executors:
            gang_on[e] = g
        heapq.heappush(completions, (g.end_s, seq, g.executors[0]))
        seq += 1

    def freed(executors: Sequence[int], t: float) -> None:
        for job in list(waiting):
            g = place_gang(sched, job, groups, t)
            if g is not None:
                waiting.remove(job)
                gang_started(g)
        for e in executors:
            if sched.idle(e):
                started(None if sched.choose(e, t) is None else sched.fill(e, t))

    while True:
        t_arr = jobs[order[nxt]].arrival_s if nxt < len(order) else math.inf
        t_done = completions[0][0] if completions else math.inf
        now = min(t_arr, t_done)
        if now == math.inf or now > horizon_s:
            break
        events += 1
        if t_done <= t_arr:
            _, _, e = heapq.heappop(completions)
            if e in gang_on:
                g = gang_on[e]
                o = outcomes[g.job.job_id]
                o.done, o.samples_done, o.filled_s = True, float(g.job.samples), g.filled_s
                for x in g.executors:
                    del gang_on[x]
                    sched.release(x, now, fill=False)
                freed(g.executors, now)
            else:
                p = sched.running[e]
                o = outcomes[p.job.job_id]
                o.done, o.samples_done, o.filled_s = True, float(p.job.samples), p.filled_s
                if waiting:
                    sched.release(e, now, fill=False)
                    freed((e,), now)
                else:
                    started(release(e, now))
        else:
            job = jobs[order[nxt]]
            nxt += 1
            if job.gpus > 1:
                if fits_somewhere(sched, job, groups):
                    g_now = place_gang(sched, job, groups, now)
                    if g_now is not None:
                        gang_started(g_now)
                    else:
                        waiting.append(job)
                else:
                    outcomes[job.job_id].rejected = (f"fill job {job.job_id!r} asks for {job.gpus} executors of one "
                                                     "class whose bubbles it fits; no class has that many")
            else:
                try:
                    started(submit(job, now))
                except ValueError as err:
                    outcomes[job.job_id].rejected = str(err)
    end_s = (horizon_s if horizon_s < math.inf
             else max((o.placement.end_s for o in outcomes.values() if o.done and o.placement), default=0.0))
    if horizon_s < math.inf:
        gangs = {id(g): g for g in gang_on.values()}
        running: list[Placement | GangPlacement] = [*sched.running.values(), *gangs.values()]
        for run in running:
            o = outcomes[run.job.job_id]
            work_s = run.processing_s - run.job.setup_s
            share = (end_s - run.start_s - run.job.setup_s) / work_s if work_s > 0 else 1.0
            share = min(max(share, 0.0), 1.0)
            o.samples_done = share * run.job.samples
            o.filled_s = share * run.filled_s
    return SimResult(main=main, policy=sched.policy.name, horizon_s=end_s, outcomes=list(outcomes.values()),
                     events=events)


def outcome_rows(r: SimResult) -> list[tuple[object, ...]]:
    """Everything an outcome holds, as plain values (placements by their fields)."""
    rows = []
    for o in r.outcomes:
        p = o.placement
        where = None if p is None else (type(p).__name__, *(getattr(p, f.name) for f in dataclasses.fields(p)))
        rows.append((o.job, where, o.done, o.samples_done, o.filled_s, o.rejected))
    return rows


def assert_same_run(fast: SimResult, ref: SimResult) -> None:
    assert (fast.events, fast.horizon_s, fast.policy) == (ref.events, ref.horizon_s, ref.policy)
    assert outcome_rows(fast) == outcome_rows(ref)


# ---- the generator ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("jobs", "hours", "seed", "deadline_share", "setup_s"), [
    (1, 1.0, 0, 0.0, 0.0), (500, 2.0, 3, 0.2, 0.0), (2000, 24.0, 0, 0.0, 0.0), (3000, 24.0, 7, 0.5, 120.0),
])
def test_the_generator_makes_the_loops_jobs(alibaba_tasks: list[AlibabaTask], jobs: int, hours: float, seed: int,
                                            deadline_share: float, setup_s: float) -> None:
    kw = {"jobs": jobs, "hours": hours, "seed": seed, "deadline_share": deadline_share, "setup_s": setup_s}
    expected = reference_generate_trace(alibaba_tasks, PROFILES, **kw)
    assert generate_trace(alibaba_tasks, PROFILES, **kw) == expected
    assert generate_table(TaskColumns.of(alibaba_tasks), PROFILES, **kw).rows() == expected
    # The packaged model's tasks, as objects (as they were) and as columns (what the command line uses now).
    model = load_trace_model()
    assert model.tasks(max(2 * jobs, 2000), seed=seed) == reference_model_tasks(max(2 * jobs, 2000), seed)
    expected = reference_generate_trace(reference_model_tasks(max(2 * jobs, 2000), seed), PROFILES, **kw)
    assert generate_table(model.columns(max(2 * jobs, 2000), seed=seed), PROFILES, **kw).rows() == expected


@settings(max_examples=30, deadline=None)
@given(jobs=st.integers(1, 400), hours=st.floats(0.01, 200.0), seed=st.integers(0, 2**32 - 1),
       deadline_share=st.floats(0.0, 1.0), slack=st.floats(0.5, 20.0), setup_s=st.sampled_from([0.0, 1.5, 600.0]),
       tasks=st.lists(st.tuples(st.integers(0, 50), st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5, 1.0])),
                      min_size=2, max_size=60))
def test_the_generator_makes_the_loops_jobs_for_any_trace(jobs: int, hours: float, seed: int, deadline_share: float,
                                                          slack: float, setup_s: float,
                                                          tasks: list[tuple[int, float]]) -> None:
    # Few distinct arrival times and sizes: ties in both sorts (by arrival, by size) and tasks of no size left out.
    trace = [AlibabaTask(f"t{k}", float(a), h) for k, (a, h) in enumerate(tasks)]
    if sum(1 for t in trace if t.gpu_hours > 0) < 2:
        with pytest.raises(ValueError, match="fewer than 2 usable tasks"):
            generate_trace(trace, PROFILES, jobs=jobs, hours=hours)
        return
    kw = {"jobs": jobs, "hours": hours, "seed": seed, "deadline_share": deadline_share, "deadline_slack": slack,
          "setup_s": setup_s}
    assert generate_trace(trace, PROFILES, **kw) == reference_generate_trace(trace, PROFILES, **kw)


def test_a_model_without_a_training_profile_runs_batch_inference_as_before(alibaba_tasks: list[AlibabaTask]) -> None:
    inference_only = {k: p for k, p in PROFILES.items() if k[1] is WorkloadKind.BATCH_INFERENCE or k[0] != "bert-base"}
    kw = {"jobs": 300, "hours": 2.0, "seed": 5}
    rows = generate_trace(alibaba_tasks, inference_only, **kw)
    assert rows == reference_generate_trace(alibaba_tasks, inference_only, **kw)
    assert {t.kind for t in rows if t.model == "bert-base"} == {WorkloadKind.BATCH_INFERENCE}


def test_a_tables_fill_jobs_are_its_rows_fill_jobs(alibaba_tasks: list[AlibabaTask]) -> None:
    table = generate_table(alibaba_tasks, PROFILES, jobs=400, hours=2.0, seed=2, deadline_share=0.3, setup_s=60.0)
    assert len(table) == 400
    assert table.fill_jobs(PROFILES, setup_s=60.0) == [t.to_fill_job(PROFILES, setup_s=60.0) for t in table.rows()]
    with pytest.raises(ValueError, match="setup time must be a finite number of seconds >= 0"):
        table.fill_jobs(PROFILES, setup_s=math.nan)


def test_task_columns_go_together() -> None:
    with pytest.raises(ValueError, match="a task's arrival and size go together"):
        TaskColumns(np.zeros(3), np.zeros(2))


# ---- the scheduler ----------------------------------------------------------------------------------------------


def test_processing_times_of_many_jobs_are_each_jobs(alibaba_tasks: list[AlibabaTask]) -> None:
    main = MainJob(stages=4, microbatches=4, data_parallel=2, free_bytes=int(2.5 * 2**30))
    sched = Scheduler(main.executor_classes(), "sjf")
    names = [c.name for c in sched.classes]
    jobs = [t.to_fill_job(PROFILES) for t in generate_trace(alibaba_tasks, PROFILES, jobs=300, hours=1.0, seed=1)]
    jobs = [dataclasses.replace(j, setup_s=30.0 * (k % 3), eligible=None if k % 4 else frozenset(names[k % 3:]))
            for k, j in enumerate(jobs)]
    many = sched.processing_times_many(jobs)
    each = np.array([sched.processing_times_s(j) for j in jobs])
    assert np.array_equal(many, each)  # inf where a job fits no configuration or may not use a class
    assert np.isinf(each).any() and np.isfinite(each).any()
    assert sched.processing_times_many([]).shape == (0, len(names))
    with pytest.raises(ValueError, match="proc_s has 2 processing times for 4 executor classes"):
        sched.submit(jobs[0], 0.0, proc_s=np.ones(2))


# ---- the engine -------------------------------------------------------------------------------------------------


def _jobs(tasks: list[AlibabaTask], n: int, hours: float, seed: int, **kw: float) -> list[FillJobRequest]:
    setup_s = kw.pop("setup_s", 0.0)
    return [t.to_fill_job(PROFILES, setup_s=setup_s)
            for t in generate_trace(tasks, PROFILES, jobs=n, hours=hours, seed=seed, setup_s=setup_s, **kw)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_engine_decides_as_the_step_by_step_engine(alibaba_tasks: list[AlibabaTask], policy: str) -> None:
    light = MainJob(stages=4, microbatches=8, data_parallel=16)  # jobs mostly start at once
    busy = MainJob(stages=4, microbatches=4, data_parallel=2, free_bytes=int(2.5 * 2**30))  # a queue, refusals
    cases = [
        (light, _jobs(alibaba_tasks, 400, 4.0, 1, deadline_share=0.3), 2.0),
        (busy, _jobs(alibaba_tasks, 300, 2.0, 2, deadline_share=0.5, setup_s=60.0), 3.0),
        (busy, _jobs(alibaba_tasks, 150, 2.0, 3), None),  # until every job is done
        (light, with_gangs(_jobs(alibaba_tasks, 300, 3.0, 4, deadline_share=0.2), 0.3, 4, seed=4), 2.5),
        (busy, with_gangs(_jobs(alibaba_tasks, 200, 2.0, 5), 0.25, 2, seed=5), None),
    ]
    for main, jobs, hours in cases:
        assert_same_run(simulate(main, jobs, policy, hours=hours), reference_simulate(main, jobs, policy, hours=hours))


def _oldest_first(job: JobInfo, state: SchedulerState, executor: int) -> float:
    return -job.arrival_s


@settings(max_examples=40, deadline=None)
@given(data=st.data(), stages=st.integers(2, 4), dp=st.integers(1, 4), microbatches=st.integers(1, 8),
       free_gib=st.sampled_from([1.0, 2.5, 4.19]), hours=st.one_of(st.none(), st.floats(0.05, 3.0)),
       policy=st.sampled_from([*POLICIES, "function"]))
def test_the_engine_decides_as_the_step_by_step_engine_for_any_trace(data: st.DataObject, stages: int, dp: int,
                                                                     microbatches: int, free_gib: float,
                                                                     hours: float | None, policy: str) -> None:
    main = MainJob(stages=stages, microbatches=microbatches, data_parallel=dp, free_bytes=int(free_gib * 2**30))
    names = [c.name for c in main.executor_classes()]
    profiles = sorted(PROFILES.values(), key=lambda p: p.key)
    # Arrivals on a coarse grid and equal sizes: jobs arriving together, completions at the same instant.
    job = st.builds(
        lambda arrival, samples, prof, deadline, setup, gpus, eligible: FillJobRequest(
            "", prof, samples, arrival, deadline, eligible, setup, gpus),
        st.integers(0, 20).map(lambda a: 300.0 * a), st.sampled_from([1, 50, 5_000, 200_000]),
        st.sampled_from(profiles), st.one_of(st.none(), st.floats(0.0, 20_000.0)), st.sampled_from([0.0, 90.0]),
        st.sampled_from([1, 1, 1, 2, dp + 1]), st.one_of(st.none(), st.sets(st.sampled_from(names)).map(frozenset)))
    raw = data.draw(st.lists(job, min_size=1, max_size=60))
    jobs = [dataclasses.replace(j, job_id=f"j{k}") for k, j in enumerate(raw)]
    chosen: str | Policy = FunctionPolicy("oldest-first", _oldest_first) if policy == "function" else policy
    fast = simulate(main, jobs, chosen, hours=hours)
    assert_same_run(fast, reference_simulate(main, jobs, get_policy(chosen), hours=hours))


def test_duplicate_ids_are_still_refused() -> None:
    job = FillJobRequest("same", next(iter(PROFILES.values())), 10)
    with pytest.raises(ValueError, match="fill job ids must be unique"):
        simulate(MainJob(stages=2, data_parallel=1), [job, dataclasses.replace(job)])


# ---- the whole path, against runs of the code before ------------------------------------------------------------


def fingerprint(rows: Sequence[TraceJob], r: SimResult) -> tuple[str, str, int]:
    """sha256 (first 16 hex digits) of the trace's rows and of every outcome, and the events."""
    th = hashlib.sha256()
    for t in rows:
        th.update(repr((t.job_id, t.arrival_s, t.model, t.kind.label, t.samples, t.deadline_s)).encode())
    oh = hashlib.sha256()
    for o in r.outcomes:
        p = o.placement
        where = None
        if p is not None:
            where = (getattr(p, "executor", None), getattr(p, "executors", None), p.start_s, p.end_s, p.steps,
                     p.config.name)
        oh.update(repr((o.job.job_id, o.job.gpus, where, o.done, o.samples_done, o.filled_s, o.rejected)).encode())
    return th.hexdigest()[:16], oh.hexdigest()[:16], r.events


# Recorded 2026-12-07 from runs of commit 9eefdf9 (before the columns and the fast engine): `bubbles simulate`'s own
# path (its packaged trace model, seed 0) through generate_trace, to_fill_job, with_gangs and simulate.
RECORDED = {
    # bubbles simulate --policy sjf (its defaults: 8,192 GPUs in 16 stages, 2,000 jobs, 24 h)
    ("sjf", 8192, 16, 2000, 24.0, 0.0, 0.0): ("7a6694e69a3a3940", "7e02e05258d656eb", 3941),
    # bubbles simulate --policy makespan --stages 4 --gpus 64 --jobs 600 --hours 6 --gang-share 0.3 --gang-gpus 4
    #   --deadline-share 0.2
    ("makespan", 64, 4, 600, 6.0, 0.3, 0.2): ("56e13649ca294bec", "ce8eb4596ba3a9f9", 937),
    ("deadline", 64, 4, 600, 6.0, 0.3, 0.2): ("56e13649ca294bec", "de602768f5d77e7e", 1041),
}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_the_command_lines_path_gives_what_the_code_before_gave(case: tuple[str, int, int, int, float, float, float]
                                                                ) -> None:
    policy, gpus, stages, n, hours, gang_share, deadline_share = case
    table = generate_table(load_trace_model().columns(max(2 * n, 2000), seed=0), PROFILES, jobs=n, hours=hours,
                           seed=0, deadline_share=deadline_share)
    jobs = with_gangs(table.fill_jobs(PROFILES), gang_share, 4, seed=0)
    main = MainJob(stages=stages, microbatches=8, data_parallel=gpus // stages)
    assert fingerprint(table.rows(), simulate(main, jobs, policy, hours=hours)) == RECORDED[case]
