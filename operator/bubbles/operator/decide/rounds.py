"""The operator's round, incremental: ``reconcile_round(view, cache)`` decides exactly what ``reconcile(view)`` does,
looking again only at what may decide otherwise than in the last round.

What a round looks at again, and what it takes from the last one (``RoundMemo``, kept in the caller's
``DecideCache``):

- A FillJob whose last decision wrote nothing to the API (a placed job followed, a final one, a deleted one without
  a finalizer) and whose inputs are the same is not looked at: its last decision is taken again (the only ones that
  repeat: its agent told its assignment again, or told to let go of its run). Its inputs: its object (the same
  object: the shell's store replaces an object on every change and never changes one in place), the views of its
  GPUs, its run's progress as its agent reports it, and what the kubelet says of its fill Pod (Pending, failed,
  ended). Each such decision also says until when it holds with the clock alone (``filljobs.Outlook``: its Pod's start
  timing out, its ETA drifting out of its slack); from then it is looked at again.
- Every other FillJob is looked at every round: a queued one (placement weighs the whole queue; its ETA and
  position move with the other jobs and the clock), one admitted, evicted, failed, finished or placed this round, or
  one whose write has not come back yet.
- A PipelineTraining's status is made again where its object, its parsed spec, its GPUs' views or the count of jobs
  on it changed, or where the last one changed a condition (the condition's time is the round's).
- Everything is looked at again (a full pass) when a setting of the view changed (the policy, the fill Pods'
  settings, the timeouts, the CUDA context allowance, the start-up grace ending, any PipelineTraining's spec or
  validity), when the clock went back, and at least every ``full_pass_s`` as a safety net.

Each memo holds its own inputs and is checked against the view before it is used, so what the shell sends is never
trusted to say what changed: a changed object is a new object, and the rest is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bubbles.core.identity import GpuKey
from bubbles.core.resources import PipelineTrainingResource

from .cache import DecideCache
from .filljobs import Outlook, see_fill_job
from .memo import REPEATABLE, JobMemo, JobReads, RoundMemo, TrainingMemo, same_inputs
from .placement import place
from .status import ACTIVE, Assigned, phase_of, status_of
from .trainings import active_placements, invalid_training_statuses, training_inputs, training_status
from .view import STARTUP_GRACE_S, ClusterView, Decisions, GpuView, key_of


def _settings(view: ClusterView, trainings: Mapping[str, PipelineTrainingResource],
              invalid: Mapping[str, str]) -> tuple[Any, ...]:
    """What every FillJob's and PipelineTraining's decision may read of the view beyond its own inputs."""
    return (view.policy, view.fill_pods, view.pod_retry_s, view.pod_start_timeout_s, view.cuda_context_bytes,
            view.acting_s < STARTUP_GRACE_S, dict(trainings), dict(invalid))


def reconcile_round(view: ClusterView, cache: DecideCache, full_pass_s: float = 30.0) -> Decisions:
    """``reconcile(view)``'s decisions, looking again only at what may decide otherwise than in the last round
    (the module's documentation says what); ``cache`` remembers the rounds (the caller's, every round). Everything is
    looked at at least every ``full_pass_s`` (the view's clock)."""
    memo = cache.rounds
    now_s = view.now.timestamp()
    out = Decisions()
    trainings, invalid = memo.parse_trainings(view.trainings)
    gpus = cache.gpus_by_key(view.gpus, trainings)
    settings = _settings(view, trainings, invalid)
    full = (memo.settings is None or settings != memo.settings or now_s < memo.now_s
            or not now_s - memo.full_at_s < full_pass_s)
    if full:
        memo.full_at_s = now_s
    memo.settings, memo.now_s, memo.full = settings, now_s, full
    jobs: dict[int, JobMemo] = {}
    valid: dict[str, Any] = {}
    busy: dict[GpuKey, tuple[str, float]] = {}
    active: list[tuple[str, tuple[GpuKey, ...]]] = []
    looked: list[tuple[str, Mapping[str, Any], Any, list[tuple[str, str, Any]], bool, Outlook]] = []
    for obj in view.fill_jobs:
        # By the object itself: a memo holds the object it was made of, so its id() is no other object's.
        m = None if full else memo.jobs.get(id(obj))
        if m is not None and m.obj is not obj:
            m = None
        if m is not None and m.repeat is not None and now_s < m.due_s and m.reads is not None \
                and same_inputs(m.inputs, m.reads.inputs(view, gpus)):
            key = m.key
            for kind, what in m.repeat:
                if kind == "assign":
                    out.assign_job(key, m.uid, what)
                else:
                    out.cancel_run(key, m.uid, what[0])
            if m.end is not None:
                end_s = m.end.at(now_s)
                for k in m.busy_keys:
                    busy[k] = (m.uid, end_s)
            if m.active is not None:
                active.append(m.active)
            jobs[id(obj)] = m
            continue
        key = key_of(obj)
        position = out.position()
        outlook = Outlook()
        seen = see_fill_job(obj, view, out, cache, gpus, trainings, invalid, busy, now_s, outlook,
                            parsed=m.job if m is not None else None)
        taken, events = out.since(position)
        if seen is not None:
            valid[seen[2].key] = seen
        looked.append((key, obj, seen, taken, bool(events), outlook))
    place(view, out, cache, valid, gpus, trainings, busy, now_s)
    for _obj, _job, st in valid.values():
        st.finish()
    for key, obj, seen, taken, evented, outlook in looked:
        jobs[id(obj)] = _remember(key, obj, seen, taken, evented, outlook, out, view, gpus)
    memo.jobs = jobs
    memo.examined = len(looked)
    active.extend(active_placements(valid))
    _training_statuses(view, out, memo, trainings, gpus, active, full)
    invalid_training_statuses(view, out, invalid)
    return out


def _remember(key: str, obj: Mapping[str, Any], seen: Any, taken: list[tuple[str, str, Any]], evented: bool,
              outlook: Outlook, out: Decisions, view: ClusterView, gpus: Mapping[GpuKey, GpuView]) -> JobMemo:
    """The memo of a FillJob looked at this round: its decision to take again while nothing changes, where it wrote
    nothing and is not queued."""
    meta = obj.get("metadata") or {}
    uid = str(meta.get("uid", ""))
    m = JobMemo(obj, key, seen[1] if seen is not None else None, uid)
    d = out.fill_jobs.get(key)
    wrote = d is not None and (d.status is not None or d.create_pod is not None or bool(d.delete_pods)
                               or d.add_finalizer or d.remove_finalizer)
    if wrote or evented or any(kind not in REPEATABLE or k != key for kind, k, _ in taken):
        return m
    before = status_of(obj)
    phase = phase_of(before)
    if meta.get("deletionTimestamp"):
        reads = JobReads(uid)  # clean_up reads the object alone
    elif phase is not None and phase.terminal:
        reads = JobReads(uid, progress_only=True)
    elif seen is not None and phase in ACTIVE and phase_of(seen[2].status) in ACTIVE:
        a = Assigned.read(before.get("assignment"))
        namespace = seen[1].namespace
        gkeys = a.gpu_keys(namespace)
        if not gkeys:
            return m
        reads = JobReads(uid, gkeys, f"{namespace}/{a.pod}")
        m.active = (f"{namespace}/{a.training}", gkeys)
    else:
        return m  # queued (placement weighs it each round), or another state looked at each round
    m.repeat = tuple((kind, what) for kind, _k, what in taken)
    m.reads, m.inputs = reads, reads.inputs(view, gpus)
    m.due_s, m.busy_keys, m.end = outlook.due_s, outlook.busy_keys, outlook.end
    return m


def _training_statuses(view: ClusterView, out: Decisions, memo: RoundMemo,
                       trainings: Mapping[str, PipelineTrainingResource], gpus: Mapping[GpuKey, GpuView],
                       active: list[tuple[str, tuple[GpuKey, ...]]], full: bool) -> None:
    """``trainings.training_statuses``, each made again only where its inputs changed."""
    by_key = {key_of(t): t for t in view.trainings}
    inputs = training_inputs(view, trainings, gpus, active)
    kept: dict[str, TrainingMemo] = {}
    for tkey, tr in trainings.items():
        obj, inp = by_key[tkey], inputs[tkey]
        tm = None if full else memo.trainings.get(tkey)
        if tm is None or not (tm.repeatable and tm.obj is obj and tm.training is tr and tm.inputs.same_as(inp)):
            status = training_status(view, obj, tr, inp)
            conditions = status_of(obj).get("conditions")
            tm = TrainingMemo(obj, tr, inp, status, status is None or status.get("conditions") == conditions)
        if tm.status is not None:
            out.training_status[tkey] = tm.status
        kept[tkey] = tm
    memo.trainings = kept


