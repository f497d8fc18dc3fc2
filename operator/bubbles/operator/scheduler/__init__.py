"""Which pending fill job runs in which training's bubbles, on which stage's GPUs: PipeFill section 4.4.

Pure Python (numpy): the scheduler knows nothing of Kubernetes. Jobs over several executors at once (gangs) are
placed beside it by ``bubbles.operator.scheduler.gang``, which reserves their executors in it. Policies are pluggable
through the ``bubbles.policies`` entry-point group (see ``bubbles.operator.scheduler.policies``).
"""

from bubbles.operator.scheduler.core import (
    DeadlineAnswer,
    ExecutorClass,
    FillConfig,
    FillJobRequest,
    FillProfile,
    Placement,
    Rate,
    Scheduler,
    best_rate,
    classes_from_cycles,
)
from bubbles.operator.scheduler.gang import (
    GangGroup,
    GangPlacement,
    choose_executors,
    fits_somewhere,
    gang_eta_s,
    place_gang,
    shared_class,
)
from bubbles.operator.scheduler.index import QueueIndex, SortedItems, StaticIndex
from bubbles.operator.scheduler.policies import (
    ENTRY_POINT_GROUP,
    DeadlinePolicy,
    FifoPolicy,
    FunctionPolicy,
    JobInfo,
    MakespanPolicy,
    Policy,
    QueueView,
    SchedulerState,
    ShortestJobFirstPolicy,
    UnknownPolicyError,
    WeightedPolicy,
    available_policies,
    get_policy,
    queue_index,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "DeadlineAnswer",
    "DeadlinePolicy",
    "ExecutorClass",
    "FifoPolicy",
    "FillConfig",
    "FillJobRequest",
    "FillProfile",
    "FunctionPolicy",
    "GangGroup",
    "GangPlacement",
    "JobInfo",
    "MakespanPolicy",
    "Placement",
    "Policy",
    "QueueIndex",
    "QueueView",
    "Rate",
    "Scheduler",
    "SchedulerState",
    "ShortestJobFirstPolicy",
    "SortedItems",
    "StaticIndex",
    "UnknownPolicyError",
    "WeightedPolicy",
    "available_policies",
    "best_rate",
    "choose_executors",
    "classes_from_cycles",
    "fits_somewhere",
    "gang_eta_s",
    "get_policy",
    "place_gang",
    "queue_index",
    "shared_class",
]
