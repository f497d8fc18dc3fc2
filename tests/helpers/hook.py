"""A stand-in for DeepSpeed's PipelineEngine that the hook can instrument: DeepSpeed's own dispatch loop and
schedules, handlers that sleep where a real stage would wait."""

from __future__ import annotations

import time
from typing import Any

from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.engine import PipelineEngine


class StandInEngine:
    """Attributes the hook uses, DeepSpeed's ``_exec_schedule``, handlers that sleep."""

    _exec_schedule = PipelineEngine._exec_schedule

    def __init__(self, stage: int, stages: int, micro_batches: int, wait_s: float = 0.002) -> None:
        self.stage_id, self.num_stages, self.micro_batches = stage, stages, micro_batches
        self.wait_s = wait_s
        self.executed: list[str] = []
        self.fail_on: str | None = None
        self._INSTRUCTION_MAP = {cls: self._handler(cls.__name__) for cls in (
            S.OptimizerStep, S.ReduceGrads, S.ReduceTiedGrads, S.LoadMicroBatch, S.ForwardPass,
            S.BackwardPass, S.SendActivation, S.RecvActivation, S.SendGrad, S.RecvGrad)}

    def _handler(self, name: str) -> Any:
        def handler(engine: StandInEngine, **kwargs: Any) -> None:
            engine.executed.append(name)
            if engine.fail_on == name:
                raise KeyError("deepspeed says no")
            if name.startswith("Recv"):
                time.sleep(engine.wait_s)
        return handler

    def _reserve_pipe_buffers(self, n: int) -> None:
        pass

    def _aggregate_total_loss(self) -> float:
        time.sleep(self.wait_s)
        return 1.5

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return self._aggregate_total_loss()

    def eval_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.InferenceSchedule(self.micro_batches, self.num_stages, self.stage_id))
        time.sleep(self.wait_s)  # the output reduction and loss broadcast
        return 2.5
