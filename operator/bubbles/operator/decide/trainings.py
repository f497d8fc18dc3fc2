"""The PipelineTrainings' statuses: their stages, each with its GPUs and their bubbles as the hooks report them, what
keeps them from reporting, the slowdown harvesting costs them, and why an invalid spec is not read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bubbles.core.api import MPS_CLIENT
from bubbles.core.identity import GpuKey
from bubbles.core.resources import (
    HOOK_SILENCE_S,
    Condition,
    ConditionType,
    FillJobResource,
    PipelineTrainingResource,
    set_condition,
)

from .status import ACTIVE, FillJobStatus, condition_of, phase_of, status_of
from .view import ClusterView, Decisions, Event, GpuView, key_of


def _gpu_status(g: GpuView, fill_jobs: int) -> dict[str, Any]:
    """One GPU of a stage, as the status lists it."""
    return {
        "rank": g.rank, "pod": g.pod, "node": g.node, **({"device": g.device} if g.device else {}),
        **({"gpuUUID": g.gpu_uuid} if g.gpu_uuid else {}), "hookReporting": g.hook_reporting,
        **({"iterationSeconds": g.cycle.iteration_s, "bubbleRatio": round(g.cycle.bubble_ratio, 4)} if g.cycle
           else {}),
        **({"shareFilled": round(min(1.0, g.filled_s / g.bubble_s), 4)} if g.bubble_s > 0 else {}),
        "fillJobs": fill_jobs,
        **({"bubbles": [{"slot": b.slot, "durationSeconds": b.duration_s, "freeBytes": b.free_bytes}
                        for b in g.cycle.slots]} if g.cycle else {}),
    }


def _stages_status(gpus: list[GpuView], placed: Mapping[GpuKey, int]) -> list[dict[str, Any]]:
    """The status's stages, each with its GPUs by rank."""
    by_stage: dict[int, list[GpuView]] = {}
    for g in gpus:
        by_stage.setdefault(g.stage, []).append(g)
    return [{"stage": k, "ranks": max(g.ranks for g in mine),
             "gpus": [_gpu_status(g, placed.get(g.key, 0)) for g in sorted(mine, key=lambda g: g.rank)]}
            for k, mine in sorted(by_stage.items())]


@dataclass(frozen=True)
class TrainingInputs:
    """What a PipelineTraining's status is made of besides its object: its GPUs that report (in the round's order of
    GPUs), its Pods' views that report none (in the view's order), how many FillJobs are placed on it, and on each of
    its reported GPUs."""

    reported: tuple[GpuView, ...] = ()
    unreported: tuple[GpuView, ...] = ()
    fill_jobs: int = 0
    per_gpu: tuple[int, ...] = ()

    def same_as(self, other: TrainingInputs) -> bool:
        """Equal, each GPU's view compared as itself first (the shell hands the same view over while it is
        unchanged)."""
        return (self.fill_jobs == other.fill_jobs and self.per_gpu == other.per_gpu
                and same_items(self.reported, other.reported) and same_items(self.unreported, other.unreported))


def same_items(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """``a == b``, each pair compared as itself first (cheap where the objects are the same)."""
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def active_placements(valid: Mapping[str, tuple[Mapping[str, Any], FillJobResource, FillJobStatus]],
                      ) -> Iterator[tuple[str, tuple[GpuKey, ...]]]:
    """(training key, GPU keys) of every placed, running or paused job of ``valid`` as its status says now."""
    for _o, j, st in valid.values():
        if phase_of(st.status) in ACTIVE:
            a = st.assignment
            yield f"{j.namespace}/{a.training}", a.gpu_keys(j.namespace)


def training_inputs(view: ClusterView, trainings: Mapping[str, PipelineTrainingResource],
                    gpus: Mapping[GpuKey, GpuView], active: Iterable[tuple[str, tuple[GpuKey, ...]]],
                    ) -> dict[str, TrainingInputs]:
    """Each valid PipelineTraining's ``TrainingInputs``; ``active``: where jobs are placed (``active_placements``)."""
    placed_on: dict[str, int] = {}
    placed_gpu: dict[GpuKey, int] = {}
    for tk, gkeys in active:
        placed_on[tk] = placed_on.get(tk, 0) + 1
        for gkey in gkeys:
            placed_gpu[gkey] = placed_gpu.get(gkey, 0) + 1
    by_training: dict[str, list[GpuView]] = {}
    for g in gpus.values():
        by_training.setdefault(g.training, []).append(g)
    # Pods that report no GPU: said, not placed on (their hook is not attached or not heard yet).
    unreported: dict[str, list[GpuView]] = {}
    for g in view.gpus:
        if not g.reported and g.training in trainings:
            unreported.setdefault(g.training, []).append(g)
    out: dict[str, TrainingInputs] = {}
    for tkey in trainings:
        reported = tuple(by_training.get(tkey, ()))
        out[tkey] = TrainingInputs(reported, tuple(unreported.get(tkey, ())), placed_on.get(tkey, 0),
                                   tuple(placed_gpu.get(g.key, 0) for g in reported))
    return out


def training_statuses(view: ClusterView, out: Decisions, trainings: Mapping[str, PipelineTrainingResource],
                      gpus: Mapping[GpuKey, GpuView],
                      valid: Mapping[str, tuple[Mapping[str, Any], FillJobResource, FillJobStatus]]) -> None:
    """Each valid PipelineTraining's status: its stages and their GPUs, conditions and figures, written where they
    changed."""
    by_key = {key_of(t): t for t in view.trainings}
    inputs = training_inputs(view, trainings, gpus, active_placements(valid))
    for tkey, tr in trainings.items():
        status = training_status(view, by_key[tkey], tr, inputs[tkey])
        if status is not None:
            out.training_status[tkey] = status


def training_status(view: ClusterView, obj: Mapping[str, Any], tr: PipelineTrainingResource,
                    inputs: TrainingInputs) -> dict[str, Any] | None:
    """One valid PipelineTraining's status (``training_statuses``), or None where it is unchanged."""
    before = status_of(obj)
    status = dict(before)
    reported = list(inputs.reported)
    mine = reported + list(inputs.unreported)
    status["pods"] = len({s.pod for s in mine})
    status["gpus"] = len(reported)
    status["gpusHarvested"] = sum(1 for n in inputs.per_gpu if n)
    placed_gpu = {g.key: n for g, n in zip(reported, inputs.per_gpu, strict=True) if n}
    status["stages"] = _stages_status(reported, placed_gpu)
    if inputs.unreported:
        status["unreportedPods"] = sorted({g.pod for g in inputs.unreported})
    else:
        status.pop("unreportedPods", None)
    profiled = [s for s in mine if s.cycle is not None]
    gen = tr.generation
    conds = set_condition(status.get("conditions") or [], Condition(
        ConditionType.ADMITTED.value, "True", "Valid", "the spec is valid", observed_generation=gen), view.now)
    # GPUs in words: a Pod runs several (stages, ranks); one not reported yet is named by its Pod alone.
    silent = [_named(s) for s in mine if not s.hook_reporting]
    # Silent and never profiled: a hook to set up. Silent after it was profiled is the training's pause (an
    # evaluation, a checkpoint), stop or hang: said apart (Silent), with no set-up advice.
    unheard = [s for s in mine if not s.hook_reporting and s.cycle is None]
    unscheduled = sorted(s.pod for s in mine if not s.node)
    no_agent = sorted({s.node for s in mine if s.node and not s.agent_up})
    if not mine:
        conds = set_condition(conds, Condition("HookReporting", "False", "NoPods", "no Pod matches spec.selector",
                                               observed_generation=gen), view.now)
    elif unscheduled:
        conds = set_condition(conds, Condition(
            "HookReporting", "False", "NotScheduled", f"Pod(s) {', '.join(unscheduled)} not on a node yet",
            observed_generation=gen), view.now)
    elif no_agent:
        # Not the hook's fault: nothing on the node can hear it (no agent Pod there, or the operator cannot call
        # the agents at all).
        conds = set_condition(conds, Condition(
            "HookReporting", "False", "NoAgent", f"no bubbles agent answers on node(s) {', '.join(no_agent)}: the "
            "agent DaemonSet must run there (its nodes need one of the chart's agent.gpuNodeLabels set to "
            "\"true\"), and the operator needs --agent-ca to call it", observed_generation=gen), view.now)
    elif silent and not unheard:
        conds = set_condition(conds, Condition(
            "HookReporting", "False", "Silent", f"no bubble signals for {HOOK_SILENCE_S:g} s from "
            f"{', '.join(sorted(silent))}, profiled before: the training stopped, is evaluating or checkpointing, "
            "or hangs. Fill jobs on those GPUs are Paused until it trains again", observed_generation=gen),
            view.now)
    elif silent:
        # A silent Pod beside one of the training's reporting Pods on its node may run a rank already reported
        # there: a second training of this name in this namespace, or the rank started twice (the hook stands such
        # a twin down: one process per GPU key and node signals).
        shared = sorted({s.pod for s in unheard if any(o.hook_reporting and o.node == s.node for o in mine)})
        twin = (f". {', '.join(shared)} share a node with Pods of this training that report: if one runs a rank "
                "already reported there (a second training of this name in this namespace, or the rank started "
                "twice), its hook stood down, as one process per rank and node is harvested (its log says so): "
                "give each training a name of its own" if shared else "")
        pods = ", ".join(sorted({_named(s) for s in unheard}))
        conds = set_condition(conds, Condition(
            "HookReporting", "False", "NoHook", f"no bubble signals from {pods}: attach the "
            "hook (bubbles.hook.instrument(engine)), set BUBBLES_TRAINING to this PipelineTraining's name and "
            "mount the bubbles volume at /run/bubbles (a csi volume of driver csi.bubbles.dev with "
            "volumeAttributes role: training; with the chart's nodeAccess hostPath, the node's run directory, "
            f"agent.runDir: docs/training-pods.md){twin}",
            observed_generation=gen), view.now)
    else:
        conds = set_condition(conds, Condition("HookReporting", "True", "Reporting",
                                               f"all {len(mine)} GPU(s) report", observed_generation=gen),
                              view.now)
    conds = set_condition(conds, Condition(
        "Profiled", "True" if mine and len(profiled) == len(mine) else "False",
        "Profiled" if mine and len(profiled) == len(mine) else "Profiling",
        f"{len(profiled)} of {len(mine)} GPU(s) profiled", observed_generation=gen), view.now)
    differ = [f"spec.{what} is {want}, the hook reports {', '.join(map(str, sorted(got)))}"
              for what, want, got in (
                  ("stages", tr.stages, {s.cycle.stages for s in profiled if s.cycle}),
                  ("microbatches", tr.microbatches, {s.cycle.microbatches for s in profiled if s.cycle}))
              if want is not None and got and got != {want}]
    if profiled and (tr.stages is not None or tr.microbatches is not None
                     or any(c.get("type") == "SpecMatches" for c in conds)):
        # Said, not acted on: the hook's figures are what the bubbles were measured with.
        conds = set_condition(conds, Condition(
            "SpecMatches", "False" if differ else "True", "Differs" if differ else "Matches",
            "; ".join(differ) + " (the hook's are used: fix the spec or the selector)" if differ
            else "the hook reports what the spec says", observed_generation=gen), view.now)
    told = sorted((s for s in mine if s.training_membership), key=lambda s: (s.stage, s.rank, s.pod))
    outside = [s for s in told if s.training_membership != MPS_CLIENT]
    had = any(c.get("type") == "MpsClient" for c in conds)
    said: Condition | None = None
    # Said, never acted on: the fill jobs' own isolation holds either way; what the training loses outside MPS is
    # concurrency (its kernels time-slice with the fill jobs' instead of running beside them). True only when every
    # profiled stage is known to be a client; a partial view (a stage restarted, not checked again yet) changes
    # nothing; nothing known at all (isolation no longer mps) says Unknown where something was said before.
    if outside:
        # The first stage's words in full, the others named (the status has room for one message, not many).
        first, more = outside[0], [f"stage {s.stage} rank {s.rank} ({s.pod} on {s.node})" for s in outside[1:]]
        text = (f"stage {first.stage} rank {first.rank} ({first.pod} on {first.node}): "
                f"{first.training_membership}") + (
            f"; likewise {', '.join(more[:20])}" + (f" and {len(more) - 20} more" if len(more) > 20
                                                             else "") if more else "")
        said = Condition("MpsClient", "False", "NotMpsClient", text, observed_generation=gen)
    elif profiled and all(s.training_membership == MPS_CLIENT for s in profiled):
        said = Condition("MpsClient", "True", "MpsClient", f"the training's process on every profiled GPU "
                         f"({len(profiled)}) is a client of its node's MPS server", observed_generation=gen)
    elif not told and had:
        said = Condition("MpsClient", "Unknown", "NotChecked", "no stage's training process has been checked "
                         "against its node's MPS server (the agents do not run mps isolation, or the check is "
                         "under way)", observed_generation=gen)
    if said is not None:
        conds = set_condition(conds, said, view.now)
    if profiled:
        bubble = sum(s.cycle.bubble_s for s in profiled if s.cycle)
        it = sum(s.cycle.iteration_s for s in profiled if s.cycle)
        status["bubbleRatio"] = round(bubble / it, 4) if it else 0.0
        status["iterationSeconds"] = sum(s.baseline_iteration_s or s.cycle.iteration_s
                                         for s in profiled if s.cycle) / len(profiled)
    harvesting = [s for s in profiled if s.iteration_s]
    if harvesting:
        status["iterationSecondsHarvesting"] = sum(s.iteration_s or 0.0 for s in harvesting) / len(harvesting)
        base = status.get("iterationSeconds") or 0.0
        slowdown = status["iterationSecondsHarvesting"] / base - 1 if base else 0.0
        status["slowdown"] = round(slowdown, 5)
        status["slowdownText"] = f"{slowdown:+.2%} of {tr.slowdown_budget:.2%}"
        over = slowdown > tr.slowdown_budget
        conds = set_condition(conds, Condition(
            "BudgetExceeded", "True" if over else "False", "OverBudget" if over else "WithinBudget",
            f"harvesting slows the training by {slowdown:+.2%}; the budget is {tr.slowdown_budget:.2%}",
            observed_generation=gen), view.now)
    bubble_total = sum(s.bubble_s for s in mine)
    if bubble_total > 0:
        status["shareFilled"] = round(sum(s.filled_s for s in mine) / bubble_total, 4)
    status["fillJobs"] = inputs.fill_jobs
    status["conditions"] = conds
    status["observedGeneration"] = gen
    return status if status != before else None


def _named(g: GpuView) -> str:
    return f"{g.pod} (stage {g.stage} rank {g.rank})" if g.reported else g.pod


def invalid_training_statuses(view: ClusterView, out: Decisions, invalid: Mapping[str, str]) -> None:
    """A PipelineTraining the operator cannot read says why in its status, with one Warning Event per new reason."""
    by_key = {key_of(t): t for t in view.trainings}
    for tkey, why in invalid.items():
        obj = by_key[tkey]
        meta = obj.get("metadata") or {}
        before = status_of(obj)
        message = (f"invalid spec: {why}; it selects no Pod until it is fixed (kubectl edit pt {meta.get('name')} "
                   f"-n {meta.get('namespace')})")
        # Only this condition: what was measured or said under an earlier, valid spec no longer holds.
        conds = set_condition([c for c in before.get("conditions") or () if c.get("type") == "Admitted"], Condition(
            ConditionType.ADMITTED.value, "False", "InvalidSpec", message,
            observed_generation=int(meta.get("generation") or 1)), view.now)
        status = {"conditions": conds, "observedGeneration": int(meta.get("generation") or 1)}
        if status != before:
            out.training_status[tkey] = status
        if condition_of(before, ConditionType.ADMITTED).get("message") != message:
            out.events.append(Event("PipelineTraining", str(meta.get("namespace", "")), str(meta.get("name", "")),
                                    str(meta.get("uid", "")), "Warning", "InvalidSpec", message))
