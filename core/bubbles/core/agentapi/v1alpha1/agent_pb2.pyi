from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("namespace", "training", "pod", "stage", "device", "cycle_json", "hook_reporting", "iteration_s", "baseline_iteration_s", "bubble_s", "filled_s", "gpu_uuid", "training_membership", "rank", "ranks", "gpu_resource")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CYCLE_JSON_FIELD_NUMBER: _ClassVar[int]
    HOOK_REPORTING_FIELD_NUMBER: _ClassVar[int]
    ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    BASELINE_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_S_FIELD_NUMBER: _ClassVar[int]
    FILLED_S_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GPU_RESOURCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    training: str
    pod: str
    stage: int
    device: str
    cycle_json: str
    hook_reporting: bool
    iteration_s: float
    baseline_iteration_s: float
    bubble_s: float
    filled_s: float
    gpu_uuid: str
    training_membership: str
    rank: int
    ranks: int
    gpu_resource: str
    def __init__(self, namespace: _Optional[str] = ..., training: _Optional[str] = ..., pod: _Optional[str] = ..., stage: _Optional[int] = ..., device: _Optional[str] = ..., cycle_json: _Optional[str] = ..., hook_reporting: _Optional[bool] = ..., iteration_s: _Optional[float] = ..., baseline_iteration_s: _Optional[float] = ..., bubble_s: _Optional[float] = ..., filled_s: _Optional[float] = ..., gpu_uuid: _Optional[str] = ..., training_membership: _Optional[str] = ..., rank: _Optional[int] = ..., ranks: _Optional[int] = ..., gpu_resource: _Optional[str] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("uid", "state", "steps_done", "flops", "reason", "kills", "attempt")
    UID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KILLS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    uid: str
    state: str
    steps_done: int
    flops: float
    reason: str
    kills: int
    attempt: int
    def __init__(self, uid: _Optional[str] = ..., state: _Optional[str] = ..., steps_done: _Optional[int] = ..., flops: _Optional[float] = ..., reason: _Optional[str] = ..., kills: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("node", "stages", "jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    node: str
    stages: _containers.RepeatedCompositeFieldContainer[StageReport]
    jobs: _containers.RepeatedCompositeFieldContainer[JobProgress]
    def __init__(self, node: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageReport, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobProgress, _Mapping]]] = ...) -> None: ...

class FillNode(_message.Message):
    __slots__ = ("duration_s", "memory_bytes")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    memory_bytes: int
    def __init__(self, duration_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class FillJobSpec(_message.Message):
    __slots__ = ("name", "interface", "entry", "command", "args_json", "steps", "memory_bytes", "step_time_s", "nodes", "stage", "kind", "init_timeout_s", "flops_per_step", "gpus")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FLOPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    interface: str
    entry: str
    command: _containers.RepeatedScalarFieldContainer[str]
    args_json: str
    steps: int
    memory_bytes: int
    step_time_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[FillNode]
    stage: int
    kind: str
    init_timeout_s: float
    flops_per_step: float
    gpus: int
    def __init__(self, name: _Optional[str] = ..., interface: _Optional[str] = ..., entry: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., args_json: _Optional[str] = ..., steps: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., step_time_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[FillNode, _Mapping]]] = ..., stage: _Optional[int] = ..., kind: _Optional[str] = ..., init_timeout_s: _Optional[float] = ..., flops_per_step: _Optional[float] = ..., gpus: _Optional[int] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("uid", "generation", "attempt", "namespace", "name", "training", "stage", "pod", "device", "gpu_uuid", "fill_pod", "spec", "slowdown_budget", "max_fill_share", "tail_risk", "ranks")
    UID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    FILL_POD_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_FILL_SHARE_FIELD_NUMBER: _ClassVar[int]
    TAIL_RISK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    generation: int
    attempt: int
    namespace: str
    name: str
    training: str
    stage: int
    pod: str
    device: str
    gpu_uuid: str
    fill_pod: str
    spec: FillJobSpec
    slowdown_budget: float
    max_fill_share: float
    tail_risk: float
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[str] = ..., generation: _Optional[int] = ..., attempt: _Optional[int] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ..., training: _Optional[str] = ..., stage: _Optional[int] = ..., pod: _Optional[str] = ..., device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., fill_pod: _Optional[str] = ..., spec: _Optional[_Union[FillJobSpec, _Mapping]] = ..., slowdown_budget: _Optional[float] = ..., max_fill_share: _Optional[float] = ..., tail_risk: _Optional[float] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("outcome", "message")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[AssignReply.Outcome]
        ACCEPTED: _ClassVar[AssignReply.Outcome]
        ALREADY_ASSIGNED: _ClassVar[AssignReply.Outcome]
        SUPERSEDED: _ClassVar[AssignReply.Outcome]
    OUTCOME_UNSPECIFIED: AssignReply.Outcome
    ACCEPTED: AssignReply.Outcome
    ALREADY_ASSIGNED: AssignReply.Outcome
    SUPERSEDED: AssignReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: AssignReply.Outcome
    message: str
    def __init__(self, outcome: _Optional[_Union[AssignReply.Outcome, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("uid", "reason")
    UID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    uid: str
    reason: str
    def __init__(self, uid: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
