"""The main (pipeline-parallel) training as the simulator sees it: its bubble cycle per stage.

PipeFill section 4.5: both GPipe and 1F1B have a fill-drain bubble of stage*(t_fwd+t_bwd) between
one iteration's drain and the next one's fill, and a fwd-bwd bubble of
    GPipe: (p - stage - 1) * (t_fwd + t_bwd)
    1F1B:  (p - stage - 1) * t_bwd + max(0, p - stage - m) * t_fwd
1F1B's remaining idle time (the total is (p-1)*(t_fwd+t_bwd) for both) is spread over short,
non-contiguous waits that PipeFill does not fill; they count towards the bubble ratio only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from bubbles.core.cycle import BubbleCycle, BubbleSlot
from bubbles.operator.scheduler.core import ExecutorClass

GIB = 2**30
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class MainJob:
    """A pipeline-parallel training: p stages, m micro-batches per replica, dp replicas of tp GPUs per stage.

    Defaults: PipeFill's simulated main job (sections 5.2 and 6.1): 16 stages, 8 micro-batches,
    8,192 GPUs, GPipe, 4.5 GB free in the bubbles; forward/backward times are our estimate for its
    40B model (2.5B parameters per stage, micro-batch 2 x 2048 tokens, 8-way tensor parallel on V100s).
    """

    stages: int = 16
    microbatches: int = 8
    data_parallel: int = 512
    tensor_parallel: int = 1
    schedule: str = "gpipe"
    fwd_s: float = 0.04
    bwd_s: float = 0.08
    free_bytes: int = int(4.5e9)
    # Share of each bubble handed to fill work. PipeFill's executors fill 68% of each bubble, which
    # keeps the training's slowdown under 2% (section 6.1, Figure 5).
    fill_fraction: float = 0.68
    name: str = "main"

    def __post_init__(self) -> None:
        problems = validate_main_job(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def gpus(self) -> int:
        return self.stages * self.data_parallel * self.tensor_parallel

    @property
    def iteration_s(self) -> float:
        return (self.microbatches + self.stages - 1) * (self.fwd_s + self.bwd_s)

    def stage_bubbles_s(self, stage: int) -> tuple[float, float]:
        """(fill-drain, fwd-bwd) bubble durations of ``stage``, PipeFill section 4.5."""
        p, m = self.stages, self.microbatches
        fill_drain = stage * (self.fwd_s + self.bwd_s)
        if self.schedule == "gpipe":
            fwd_bwd = (p - stage - 1) * (self.fwd_s + self.bwd_s)
        else:
            fwd_bwd = (p - stage - 1) * self.bwd_s + max(0, p - stage - m) * self.fwd_s
        return fill_drain, fwd_bwd

    def cycle(self, stage: int) -> BubbleCycle:
        """Stage ``stage``'s bubble cycle: the fillable bubbles (scaled by ``fill_fraction``) and, for
        1F1B, one ``steady`` slot with the non-contiguous remainder (free_bytes 0: never filled)."""
        fill_drain, fwd_bwd = self.stage_bubbles_s(stage)
        total = (self.stages - 1) * (self.fwd_s + self.bwd_s)
        slots: list[BubbleSlot] = []
        pos = 0
        for kind, instr, dur in (("fwd-bwd", "RecvGrad", fwd_bwd), ("drain", "LossBroadcast", fill_drain)):
            if dur > 0:
                used = dur * self.fill_fraction
                slots.append(BubbleSlot(len(slots), pos, instr, kind, used, used, used, self.free_bytes))
            pos += 1
        rest = total - fill_drain - fwd_bwd
        if rest > 1e-12:
            slots.append(BubbleSlot(len(slots), pos, "RecvActivation", "steady", 0.0, 0.0, 0.0, 0))
        return BubbleCycle(
            training=self.name,
            stage=stage,
            stages=self.stages,
            microbatches=self.microbatches,
            schedule=self.schedule,
            iteration_s=self.iteration_s,
            slots=tuple(slots),
            samples=1,
        )

    def bubble_ratio(self) -> float:
        """Idle share of the main job's GPU time: (p-1)/(m+p-1) for both schedules."""
        total = sum(sum(self.stage_bubbles_s(s)) for s in range(self.stages))
        if self.schedule == "1f1b":
            total = self.stages * (self.stages - 1) * (self.fwd_s + self.bwd_s)
        return total / (self.stages * self.iteration_s)

    def fillable_ratio(self) -> float:
        """Share of GPU time in bubbles PipeFill fills (fill-drain and fwd-bwd), before fill_fraction."""
        total = sum(sum(self.stage_bubbles_s(s)) for s in range(self.stages))
        return total / (self.stages * self.iteration_s)

    def executor_classes(self) -> list[ExecutorClass]:
        """One class per stage (dp x tp GPUs each); the steady 1F1B remainder is left out of the plan."""
        out = []
        for s in range(self.stages):
            cyc = self.cycle(s)
            fillable = tuple(x for x in cyc.slots if x.kind != "steady")
            cyc = BubbleCycle(
                cyc.training,
                cyc.stage,
                cyc.stages,
                cyc.microbatches,
                cyc.schedule,
                cyc.iteration_s,
                fillable,
                cyc.samples,
            )
            out.append(ExecutorClass.from_cycle(cyc, self.data_parallel * self.tensor_parallel))
        return out

    def with_gpus(self, gpus: int, *, keep_global_batch: bool = True) -> MainJob:
        """The same training on ``gpus`` GPUs; with a fixed global batch, fewer micro-batches per replica."""
        dp = max(1, gpus // (self.stages * self.tensor_parallel))
        m = self.microbatches
        if keep_global_batch:
            m = max(1, round(self.microbatches * self.data_parallel / dp))
        return MainJob(
            self.stages,
            m,
            dp,
            self.tensor_parallel,
            self.schedule,
            self.fwd_s,
            self.bwd_s,
            self.free_bytes,
            self.fill_fraction,
            self.name,
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["gpus"] = self.gpus
        d["iteration_s"] = self.iteration_s
        return d


def validate_main_job(j: MainJob) -> list[str]:
    """Every problem with a main-job description, each saying what to use instead."""
    out = []
    for name in ("stages", "microbatches", "data_parallel", "tensor_parallel"):
        v = getattr(j, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            out.append(f"{name} must be an integer >= 1, got {v!r}")
    if j.schedule not in SCHEDULES:
        out.append(f"schedule {j.schedule!r} is not one of {', '.join(SCHEDULES)}")
    for name in ("fwd_s", "bwd_s"):
        v = getattr(j, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            out.append(f"{name} must be a number of seconds > 0 (time per micro-batch per stage), got {v!r}")
    if isinstance(j.free_bytes, bool) or not isinstance(j.free_bytes, int) or j.free_bytes < 0:
        out.append(f"free_bytes must be an integer >= 0, got {j.free_bytes!r}")
    f = j.fill_fraction
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
        out.append(f"fill_fraction must be in (0, 1], got {f!r}")
    return out
