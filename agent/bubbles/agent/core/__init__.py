"""The agent's decisions, as a pure core: inputs in, actions out, the clock injected (``AgentCore``).

Its rooms: ``actions`` (what it decides), ``timers`` (its typed timer heap), ``membership`` (the check of the
training's MPS membership), ``ending`` (when the training has ended, for ``--exit-when-done``), ``planning`` (a fill
job's steps per iteration, planned and compared with what ran), ``records`` (its state), ``reporting`` (metrics
totals, the status and the summary), ``config`` (``CoreConfig``), ``jobs`` (the core's state and what it does to a
job) and ``agent`` (``AgentCore``'s decisions).
This package re-exports what the rest of the agent uses.
"""

from .actions import Action, Launch, Release, Send, Signal, VerifyIsolation, VerifyTraining
from .agent import (
    FUTURE_SLACK_NS,
    MAX_BUBBLE_RECORDS,
    MAX_OPEN_BUBBLES,
    MAX_STEP_RECORDS,
    AgentCore,
    effective_status,
    sent_by_the_training,
)
from .config import CoreConfig
from .ending import ENDED_AFTER_S, WATCH_INTERVAL_S, Ending, HookFacts, HookState, TrainingEnd, hook_state
from .jobs import MAX_EVENTS, MAX_ISOLATION_RESUBMISSIONS, MAX_STOPPED_JOBS, STOP_GRACE_S
from .membership import TRAINING_RECHECK_S, MembershipCheck, TrainingMembership
from .planning import PLAN_FACTOR, PLAN_SLACK_STEPS, PlanCheck, PlanWatch, within_factor
from .records import MODE_SETTLE_ITERATIONS, UNISOLATED, ExecutorState, JobRecord, OpenBubble
from .reporting import IsolationTotals, JobTotals, MetricsSink, NullSink, Snapshot, StageTotals
from .timers import Timer, TimerKind

__all__ = [
    "ENDED_AFTER_S",
    "FUTURE_SLACK_NS",
    "MAX_BUBBLE_RECORDS",
    "MAX_EVENTS",
    "MAX_ISOLATION_RESUBMISSIONS",
    "MAX_OPEN_BUBBLES",
    "MAX_STEP_RECORDS",
    "MAX_STOPPED_JOBS",
    "MODE_SETTLE_ITERATIONS",
    "PLAN_FACTOR",
    "PLAN_SLACK_STEPS",
    "STOP_GRACE_S",
    "TRAINING_RECHECK_S",
    "UNISOLATED",
    "WATCH_INTERVAL_S",
    "Action",
    "AgentCore",
    "CoreConfig",
    "Ending",
    "ExecutorState",
    "HookFacts",
    "HookState",
    "IsolationTotals",
    "JobRecord",
    "JobTotals",
    "Launch",
    "MembershipCheck",
    "MetricsSink",
    "NullSink",
    "OpenBubble",
    "PlanCheck",
    "PlanWatch",
    "Release",
    "Send",
    "Signal",
    "Snapshot",
    "StageTotals",
    "Timer",
    "TimerKind",
    "TrainingEnd",
    "TrainingMembership",
    "VerifyIsolation",
    "VerifyTraining",
    "effective_status",
    "hook_state",
    "sent_by_the_training",
    "within_factor",
]
