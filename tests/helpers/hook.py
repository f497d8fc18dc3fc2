"""A stand-in for DeepSpeed's PipelineEngine that the hook can instrument: DeepSpeed's own dispatch loop and
schedules, handlers that sleep where a real stage would wait."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.engine import PipelineEngine

from bubbles.core import paths, wire


class StandInEngine:
    """Attributes the hook uses, DeepSpeed's ``_exec_schedule``, handlers that sleep."""

    _exec_schedule = PipelineEngine._exec_schedule

    def __init__(self, stage: int, stages: int, micro_batches: int, wait_s: float = 0.002,
                 backend: StandInBackend | None = None, grid: StandInGrid | None = None) -> None:
        self.stage_id, self.num_stages, self.micro_batches = stage, stages, micro_batches
        if grid is not None:  # DeepSpeed's PipelineEngine has one (engine.grid); without it: one rank per stage
            self.grid = grid
        self.wait_s = wait_s
        # With a backend, OptimizerStep all-reduces the gradient norm through it (clipping), ReduceGrads all-reduces
        # asynchronously and the loss broadcast broadcasts: what DeepSpeed's engine does through deepspeed.comm.
        self.backend = backend
        self.norm_all_reduces = 1
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
            if engine.backend is not None and name == "OptimizerStep":
                for _ in range(engine.norm_all_reduces):
                    engine.backend.all_reduce([1.0], "sum", None, False)  # DeepSpeed passes these positionally
            if engine.backend is not None and name == "ReduceGrads":
                engine.backend.all_reduce([2.0], group=None, async_op=True).wait()
        return handler

    def _reserve_pipe_buffers(self, n: int) -> None:
        pass

    def _aggregate_total_loss(self) -> float:
        time.sleep(self.wait_s)
        if self.backend is not None:
            self.backend.broadcast([1.5], 1)
        return 1.5

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return self._aggregate_total_loss()

    def eval_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.InferenceSchedule(self.micro_batches, self.num_stages, self.stage_id))
        time.sleep(self.wait_s)  # the output reduction and loss broadcast
        return 2.5


class StandInGrid:
    """DeepSpeed's ``PipelineParallelGrid`` as the hook reads it: this process's model-parallel (DeepSpeed's "slice")
    and data-parallel place within its stage."""

    def __init__(self, mp_rank: int = 0, mp_size: int = 1, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.mp_rank, self.mp_size, self.dp_rank, self.dp_size = mp_rank, mp_size, dp_rank, dp_size

    def get_slice_parallel_rank(self) -> int:
        return self.mp_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.mp_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size


class StandInWork:
    def wait(self) -> bool:
        return True


class StandInBackend:
    """DeepSpeed's communication backend object (``deepspeed.comm.comm.cdb``) as the hook sees it: collectives with
    TorchBackend's signatures, a blocking one sleeping ``wait_s`` (the other ranks are late), an ``async_op=True`` one
    returning a Work at once. ``calls`` lists (op, async, thread name)."""

    def __init__(self, wait_s: float = 0.003) -> None:
        self.wait_s = wait_s
        self.calls: list[tuple[str, bool, str]] = []

    def _call(self, op: str, async_op: bool) -> StandInWork | None:
        self.calls.append((op, bool(async_op), threading.current_thread().name))
        if async_op:
            return StandInWork()
        time.sleep(self.wait_s)
        return None

    def all_reduce(self, tensor: Any, op: Any = "sum", group: Any = None, async_op: bool = False) -> Any:
        return self._call("all_reduce", async_op)

    def all_reduce_coalesced(self, tensors: Any, op: Any = "sum", group: Any = None, async_op: bool = False) -> Any:
        # TorchBackend's goes to torch directly; one that calls another collective of its own is one wait, not two
        for t in tensors:
            self.all_reduce(t, op, group, async_op)
        return None

    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
        return self._call("broadcast", async_op)

    def barrier(self, group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        return self._call("barrier", async_op)


def gpu_dir(run_dir: Path | str, training: str, stage: int, rank: int = 0) -> Path:
    """The directory (made) where the hook of ``rank`` of ``stage`` signals: the namespace is the one the hook
    takes (``$POD_NAMESPACE``, ``_local`` outside Kubernetes)."""
    return paths.make_private_dir(paths.gpu_dir(run_dir, paths.GpuKey(paths.default_namespace(), training, stage,
                                                                      rank)))


def bind(path: Path, rcvbuf: int | None = None) -> socket.socket:
    """A non-blocking datagram socket at ``path``: a listener the hook finds and signals."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind(str(path))
    s.setblocking(False)
    return s


def drain(s: socket.socket) -> list[wire.Message]:
    """Every message waiting on ``s``, decoded."""
    out = []
    while True:
        try:
            out.append(wire.decode(s.recv(wire.MAX_DATAGRAM_BYTES)))
        except BlockingIOError:
            return out
