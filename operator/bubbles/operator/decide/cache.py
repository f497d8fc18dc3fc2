"""What the reconcile remembers between rounds: parsed FillJob specs, scheduler profiles and GPUs' executor classes.

The shell owns one ``DecideCache`` and hands it to every ``reconcile``; each memo's key holds all its result depends
on, so a memo never changes a decision, only its cost (a thousand unchanged specs re-validated every round would
dominate the round).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from bubbles.core.api import WorkloadKind
from bubbles.core.identity import GpuKey
from bubbles.core.plan import Bubble, FillNode
from bubbles.core.resources import FillJobResource, PipelineTrainingResource
from bubbles.operator.scheduler import ExecutorClass, FillConfig, FillProfile

from .memo import RoundMemo
from .view import PROVISIONAL_STEP_S, GpuView, gpus_by_key

# Past these sizes a memo starts again (bounded memory for a long-lived operator).
MAX_PARSED = 100_000
MAX_PROFILES = 10_000
MAX_CLASSES = 100_000


class DecideCache:
    """Memos of pure values across reconcile rounds (``reconcile``'s default is a fresh one: nothing remembered)."""

    def __init__(self) -> None:
        self.parsed: dict[tuple[str, str, str, str, str, str], FillJobResource] = {}
        self.profiles: dict[tuple[Any, ...], FillProfile] = {}
        # GPU -> (cycle, share, reserve, class): a GPU's class is rebuilt only when its cycle object or its training's
        # share or reserve changes (the shell hands the same cycle object over while the report is unchanged).
        self.classes: dict[GpuKey, tuple[Any, float, int, ExecutorClass]] = {}
        # placement's frame of the last round's GPUs: (what it was made of, placement.GpuFrame)
        self.gpu_frame: tuple[tuple[Any, ...], Any] | None = None
        self.rounds = RoundMemo()  # what the incremental round (rounds.reconcile_round) remembers
        self._gpus: tuple[tuple[Any, ...], dict[GpuKey, GpuView]] | None = None

    def gpus_by_key(self, gpus: Sequence[GpuView], trainings: Collection[str]) -> dict[GpuKey, GpuView]:
        """``view.gpus_by_key`` of the GPUs of ``trainings`` (keys), remembered while the GPUs' views are the same
        (the shell hands them over as the same objects while they are unchanged). The answer is shared: not to be
        changed."""
        key = (tuple(gpus), tuple(trainings))
        if self._gpus is None or self._gpus[0] != key:
            self._gpus = (key, gpus_by_key(g for g in gpus if g.training in trainings))
        return self._gpus[1]

    def fill_job(self, obj: Mapping[str, Any]) -> FillJobResource:
        """``FillJobResource.from_object``, remembered per what it reads: identity, generation, labels and spec."""
        meta = obj.get("metadata") or {}
        key = (str(meta.get("uid") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""),
               str(meta.get("generation") or 1), json.dumps(meta.get("labels") or {}, sort_keys=True, default=str),
               json.dumps(obj.get("spec"), sort_keys=True, default=str))
        job = self.parsed.get(key)
        if job is None:
            if len(self.parsed) > MAX_PARSED:
                self.parsed.clear()
            job = self.parsed[key] = FillJobResource.from_object(obj)
        return job

    def profile(self, job: FillJobResource) -> FillProfile:
        """The scheduler's profile of a job, one object per shape: the scheduler caches a profile's processing
        times per object, so jobs of one shape share them (bounded by the shapes seen)."""
        step_s = job.job.gating_step_s or PROVISIONAL_STEP_S
        nodes = tuple(job.job.plan_nodes(step_s) or (FillNode(step_s, job.job.memory_bytes),))
        kind = job.job.kind or WorkloadKind.TRAINING
        key = (kind, job.samples_per_step, job.flops_per_step, nodes)
        prof = self.profiles.get(key)
        if prof is None:
            if len(self.profiles) > MAX_PROFILES:
                self.profiles.clear()
            shape = f"{kind}:{job.samples_per_step}:" + ",".join(f"{n.duration_s:.9g}/{n.memory_bytes}"
                                                                for n in nodes)
            prof = self.profiles[key] = FillProfile(shape, kind, job.flops_per_step or 0.0, 0.0,
                                                    (FillConfig("spec", job.samples_per_step, nodes),))
        return prof

    def executor_class(self, gpu: GpuView, training: PipelineTrainingResource,
                       context_bytes: int = 0) -> ExecutorClass:
        """The scheduler's view of one GPU, one executor named by its key: its bubbles cut to the training's share
        and memory reserve (and the fill process's CUDA context, ``context_bytes``, where the agent plans one:
        ``gpu_context_bytes``)."""
        assert gpu.cycle is not None
        reserve = training.memory_reserve_bytes + context_bytes
        key = gpu.key
        have = self.classes.get(key)
        if have is not None and have[0] is gpu.cycle and have[1] == training.max_fill_share and have[2] == reserve:
            return have[3]
        bubbles = tuple(Bubble(s.duration_s * training.max_fill_share,
                               max(0, s.free_bytes - reserve),
                               f"{gpu.where} slot {s.slot}") for s in gpu.cycle.slots)
        cls = ExecutorClass(str(key), bubbles, gpu.cycle.iteration_s, 1)
        if len(self.classes) > MAX_CLASSES:
            self.classes.clear()
        self.classes[key] = (gpu.cycle, training.max_fill_share, reserve, cls)
        return cls
