"""The custom resources users write (``FillJob``, ``PipelineTraining``, group ``bubbles.dev``), defined once.

Each resource's ``spec`` is a table of ``Field`` values. From that one table come the CRD's structural
OpenAPI schema (``openapi_schema``, used by ``bubbles.operator.crd`` to write ``crds/``), the operator's own
validation (``validate``: the same rules the API server enforces, for emulators and for messages that name
the field and the fix) and the defaults (``apply_defaults``). The typed views (``FillJobResource``,
``PipelineTrainingResource``) are built from a validated spec, and a FillJob maps onto the agent's
``bubbles.core.api.FillJobSpec``. Statuses use the phases, conditions and field names here, so the operator, the
CRDs' printer columns and the docs cannot drift apart. Pure: no Kubernetes client, no I/O.

- ``schema``: the ``Field`` table itself and what comes of one: schema, validation, defaults, label selectors;
- ``phases``: the FillJob's phases and both resources' conditions (``set_condition``);
- ``filljob``: the FillJob's spec and status tables, the fill Pod's reserved names and paths, ``FillJobResource``;
- ``pipelinetraining``: the PipelineTraining's spec and status tables, ``PipelineTrainingResource``;
- ``reports``: what node agents report to the operator (``NodeReport``, ``StageReport``, ``JobProgress``).
"""

from bubbles.core.api import FillState  # JobProgress.state's type, imported from here by existing callers

from .filljob import (
    FILL_JOB_RULES,
    FILL_JOB_SPEC,
    FILL_JOB_STATUS,
    RESERVED_ENV_PREFIXES,
    RUNTIME_PATHS,
    RUNTIME_VOLUMES,
    VOLUME_SOURCES,
    FillJobResource,
    checkpoint_path,
    inside,
    mount_path_problem,
)
from .phases import Condition, ConditionType, FillJobPhase, rfc3339, set_condition
from .pipelinetraining import PIPELINE_TRAINING_SPEC, PIPELINE_TRAINING_STATUS, PipelineTrainingResource
from .reports import HOOK_SILENCE_S, JobProgress, NodeReport, StageReport
from .schema import (
    CPU_PATTERN,
    DNS_LABEL_PATTERN,
    DNS_NAME_PATTERN,
    DURATION_PATTERN,
    ENTRY_PATTERN,
    ENV_NAME_PATTERN,
    IMAGE_PATTERN,
    LABEL_KEY_PATTERN,
    QUANTITY_PATTERN,
    TIMEOUT_PATTERN,
    Field,
    ResourceError,
    apply_defaults,
    openapi_schema,
    parse_cpu,
    selector_matches,
    spec_schema,
    validate,
)

GROUP = "bubbles.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/fill-job-cleanup"

__all__ = [
    "API_VERSION",
    "CPU_PATTERN",
    "DNS_LABEL_PATTERN",
    "DNS_NAME_PATTERN",
    "DURATION_PATTERN",
    "ENTRY_PATTERN",
    "ENV_NAME_PATTERN",
    "FILL_JOB_RULES",
    "FILL_JOB_SPEC",
    "FILL_JOB_STATUS",
    "FINALIZER",
    "GROUP",
    "HOOK_SILENCE_S",
    "IMAGE_PATTERN",
    "LABEL_KEY_PATTERN",
    "PIPELINE_TRAINING_SPEC",
    "PIPELINE_TRAINING_STATUS",
    "QUANTITY_PATTERN",
    "RESERVED_ENV_PREFIXES",
    "RUNTIME_PATHS",
    "RUNTIME_VOLUMES",
    "TIMEOUT_PATTERN",
    "VERSION",
    "VOLUME_SOURCES",
    "Condition",
    "ConditionType",
    "Field",
    "FillJobPhase",
    "FillJobResource",
    "FillState",
    "JobProgress",
    "NodeReport",
    "PipelineTrainingResource",
    "ResourceError",
    "StageReport",
    "apply_defaults",
    "checkpoint_path",
    "inside",
    "mount_path_problem",
    "openapi_schema",
    "parse_cpu",
    "rfc3339",
    "selector_matches",
    "set_condition",
    "spec_schema",
    "validate",
]
