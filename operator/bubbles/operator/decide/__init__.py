"""What the operator decides, as one pure function of what it sees: ``reconcile(view, cache) -> Decisions``.

The shell (``bubbles.operator.shell``) gathers the view (FillJobs, PipelineTrainings, the training Pods, what the
node agents report) and carries the decisions out (status patches, fill Pods, assignments to agents, Events), each
FillJob's together. Nothing here calls Kubernetes or an agent, reads a clock or sleeps: the time comes in with the
view, so every decision can be replayed in a test; what it remembers between rounds is in the ``DecideCache`` the
caller owns.

Level-triggered: the status of each FillJob is the record of where it runs. A job whose status names an
assignment is placed, whatever the operator remembers, so a restarted operator places nothing twice.

Its unit is one harvested GPU (``GpuView``, keyed by ``identity.GpuKey``: namespace, training, stage, rank): a Pod
that runs several stages or several ranks of one is several GPUs, each with bubbles of its own, each placed on alone.

``view``: what it sees and decides; ``status``: a FillJob's status and its phase transitions; ``filljobs``:
tracking; ``placement``: queued jobs onto GPUs; ``pods``: the fill Pod; ``trainings``: the PipelineTrainings'
statuses; ``cache``: the memos.
"""

from __future__ import annotations

from bubbles.core.resources import JobProgress, PipelineTrainingResource, ResourceError

from .cache import DecideCache
from .filljobs import see_fill_jobs
from .placement import place
from .pods import fill_pod, fill_pod_mounts, fill_pod_name, fill_pod_node, fill_pod_place, label_value, pod_not_starting
from .rounds import reconcile_round
from .status import ACTIVE, PHASE_TRANSITIONS, Assigned, FillJobStatus, InvalidTransition, check_transition
from .trainings import invalid_training_statuses, training_statuses
from .view import (
    PROVISIONAL_STEP_S,
    RUN_DIR,
    STARTUP_GRACE_S,
    Assignment,
    ClusterView,
    Decisions,
    Event,
    FillJobDecisions,
    FillPodSettings,
    GpuView,
    gpu_context_bytes,
    gpus_by_key,
    key_of,
)

__all__ = [
    "ACTIVE",
    "PHASE_TRANSITIONS",
    "PROVISIONAL_STEP_S",
    "RUN_DIR",
    "STARTUP_GRACE_S",
    "Assigned",
    "Assignment",
    "ClusterView",
    "DecideCache",
    "Decisions",
    "Event",
    "FillJobDecisions",
    "FillJobStatus",
    "FillPodSettings",
    "GpuView",
    "InvalidTransition",
    "JobProgress",
    "check_transition",
    "fill_pod",
    "fill_pod_mounts",
    "fill_pod_name",
    "fill_pod_node",
    "fill_pod_place",
    "gpu_context_bytes",
    "gpus_by_key",
    "key_of",
    "label_value",
    "pod_not_starting",
    "reconcile",
    "reconcile_round",
]


def reconcile(view: ClusterView, cache: DecideCache | None = None) -> Decisions:
    """Every decision for the cluster as it is now: statuses, fill Pods, assignments, cancellations, Events.
    ``cache``: what earlier rounds remembered (the shell's own, every round); a fresh one by default."""
    cache = cache if cache is not None else DecideCache()
    out = Decisions()
    trainings: dict[str, PipelineTrainingResource] = {}
    invalid: dict[str, str] = {}
    for t in view.trainings:
        try:
            trainings[key_of(t)] = PipelineTrainingResource.from_object(t)
        except ResourceError as exc:
            invalid[key_of(t)] = str(exc)  # said in its status; it selects no Pod until it is fixed
    gpus = cache.gpus_by_key(view.gpus, trainings)
    valid, busy = see_fill_jobs(view, out, cache, gpus, trainings, invalid)
    place(view, out, cache, valid, gpus, trainings, busy, view.now.timestamp())
    for _obj, _job, st in valid.values():
        st.finish()
    training_statuses(view, out, trainings, gpus, valid)
    invalid_training_statuses(view, out, invalid)
    return out
