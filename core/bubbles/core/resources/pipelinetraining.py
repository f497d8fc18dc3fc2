"""The ``PipelineTraining`` resource: its spec's table, the typed view ``PipelineTrainingResource`` and its
status's table (each stage's GPUs as their hooks profiled them, the slowdown against the budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bubbles.core.api import DEFAULT_TAIL_RISK, MAX_TAIL_RISK, parse_quantity
from bubbles.core.identity import check_name

from .phases import conditions_field
from .schema import Field, ResourceError, label_selector_field, valid_spec

PIPELINE_TRAINING_SPEC: tuple[Field, ...] = (
    label_selector_field("selector", "labels of the training's Pods (a Pod may run several stages, and several "
                         "ranks of a stage: tensor- and data-parallel ones)",
                         required=True, rules=((
                             "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
                             "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
                             "the selector must select the training's Pods, e.g. matchLabels: {app: llama-70b}"),)),
    Field("stages", "integer", "pipeline stages, as a check: the status says (condition SpecMatches) when the hook "
          "reports others; left out: what the hook reports", minimum=1, maximum=1024),
    Field("microbatches", "integer", "micro-batches per iteration, as a check like stages; left out: what the "
          "hook reports", minimum=1, maximum=65536),
    Field("slowdownBudget", "number", "training slowdown harvesting may cause (0.01 = 1%)", default=0.01,
          minimum=0.0001, maximum=0.5),
    Field("maxFillShare", "number", "the largest share of each bubble fill work may use", default=1.0,
          minimum=0.0, maximum=1.0),
    Field("memoryReserve", "quantity", "accelerator memory fill jobs never touch, on top of what the hook "
          "measured free", default="0"),
    Field("tailRisk", "number", "the most risk a fill step started past a bubble's predicted end may take of "
          "outliving the bubble (0: never start one); caps each fill job's own setting, applies to running fill "
          "jobs at once", default=DEFAULT_TAIL_RISK, minimum=0.0, maximum=MAX_TAIL_RISK),
)


@dataclass(frozen=True)
class PipelineTrainingResource:
    """A validated PipelineTraining."""

    name: str
    namespace: str
    uid: str
    generation: int
    selector: dict[str, Any]
    stages: int | None
    microbatches: int | None
    slowdown_budget: float
    max_fill_share: float
    memory_reserve_bytes: int
    labels: dict[str, str] = field(default_factory=dict)
    tail_risk: float = DEFAULT_TAIL_RISK

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PipelineTrainingResource:
        meta = obj.get("metadata") or {}
        try:
            # Its name is its hooks' $BUBBLES_TRAINING and a directory on every node (identity.GpuKey): a DNS label.
            check_name("PipelineTraining", str(meta.get("name", "")))
        except ValueError as exc:
            raise ResourceError(f"{exc}; its hooks name it in $BUBBLES_TRAINING and its nodes' run directories: "
                                "re-create it under a shorter name") from None
        s = valid_spec(PIPELINE_TRAINING_SPEC, obj)
        if not (s.get("selector") or {}).get("matchLabels") and not (s.get("selector") or {}).get("matchExpressions"):
            raise ResourceError("spec.selector must select the training's Pods, e.g. matchLabels: {app: llama-70b}")
        return cls(
            name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")), uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation") or 1), selector=dict(s["selector"]), stages=s.get("stages"),
            microbatches=s.get("microbatches"), slowdown_budget=float(s["slowdownBudget"]),
            max_fill_share=float(s["maxFillShare"]),
            memory_reserve_bytes=parse_quantity(s["memoryReserve"], "spec.memoryReserve"),
            labels=dict(meta.get("labels") or {}), tail_risk=float(s["tailRisk"]),
        )


# -- its status (written by the operator; declared in full so the API server prunes none of it) ----------------
PIPELINE_TRAINING_STATUS: tuple[Field, ...] = (
    Field("observedGeneration", "integer", "the spec generation this status is for", minimum=0),
    Field("pods", "integer", "training Pods the selector matches", minimum=0),
    Field("gpus", "integer", "GPUs its hooks report: every rank of every stage, on every node", minimum=0),
    Field("gpusHarvested", "integer", "of those, GPUs a fill job is placed on", minimum=0),
    Field("unreportedPods", "array", "Pods the selector matches whose GPUs no agent reports yet (the conditions say "
          "why)", items=Field("pod", "string", "a training Pod")),
    Field("stages", "array", "per pipeline stage: its GPUs (ranks), where each runs and its profiled bubbles",
          items=Field("stage", "object", "one stage", fields=(
              Field("stage", "integer", "the stage's index", minimum=0),
              Field("ranks", "integer", "how many ranks (GPUs) the stage has, as its hooks report", minimum=1),
              Field("gpus", "array", "its ranks reported, each one GPU", items=Field("gpu", "object", "one GPU",
                    fields=(
                        Field("rank", "integer", "its index among the stage's ranks", minimum=0),
                        Field("pod", "string", "the training Pod whose process runs it"),
                        Field("node", "string", "its node"),
                        Field("device", "string", "its device in that process, e.g. cuda:1"),
                        Field("gpuUUID", "string", "its UUID, where the agent knows it (NVML)"),
                        Field("hookReporting", "boolean", "whether its hook sent bubble signals lately"),
                        Field("iterationSeconds", "number", "its profiled iteration time", minimum=0),
                        Field("bubbleRatio", "number", "share of the iteration it idles", minimum=0, maximum=1),
                        Field("shareFilled", "number", "share of its bubble time fill jobs used", minimum=0,
                              maximum=1),
                        Field("fillJobs", "integer", "fill jobs placed on it", minimum=0),
                        Field("bubbles", "array", "its profiled bubble cycle", items=Field(
                            "bubble", "object", "one bubble", fields=(
                                Field("slot", "integer", "position in the cycle", minimum=0),
                                Field("durationSeconds", "number", "median length", minimum=0),
                                Field("freeBytes", "integer", "accelerator memory free in it", minimum=0),
                            ))),
                    ))),
          ))),
    Field("bubbleRatio", "number", "share of the training's GPU time spent in bubbles", minimum=0, maximum=1),
    Field("iterationSeconds", "number", "iteration time without harvesting", minimum=0),
    Field("iterationSecondsHarvesting", "number", "iteration time while fill jobs run", minimum=0),
    Field("slowdown", "number", "iteration time lost to harvesting (0.004 = 0.4%)"),
    Field("slowdownText", "string", "slowdown against the budget, for kubectl's columns"),
    Field("shareFilled", "number", "share of bubble time fill jobs used", minimum=0, maximum=1),
    Field("recoveredFlopsPerSecond", "number", "fill-job FLOP/s recovered from the bubbles", minimum=0),
    Field("fillJobs", "integer", "fill jobs placed on this training", minimum=0),
    conditions_field(),
)
