"""One pipeline stage on one device: real transformer compute, the other stages' waits emulated.

``StageEmulator`` looks enough like a DeepSpeed ``PipelineEngine`` that the real hook
(``bubbles.hook.instrument``) instruments it unchanged: ``stage_id``, ``num_stages``, ``micro_batches``,
``device``, an ``_INSTRUCTION_MAP`` from DeepSpeed's own instruction classes
(``deepspeed.runtime.pipe.schedule``) to handlers called as ``handler(self, **cmd.kwargs)``, exactly as
``PipelineEngine._exec_schedule`` calls them, ``_exec_schedule``, ``_aggregate_total_loss``, ``train_batch``
and ``eval_batch``. ``train_batch`` runs DeepSpeed's real ``TrainSchedule`` for this stage.

Compute is real: a stack of transformer blocks (attention through ``scaled_dot_product_attention`` and an
MLP), bf16 on CUDA, fp32 on CPU; a forward pass per micro-batch, a backward pass per micro-batch with the
activations kept in between as 1F1B keeps them, and the optimizer step at ``OptimizerStep``.

The neighbours are emulated. Each receive and the end-of-batch loss broadcast is a wait of the modelled length
that starts when the device gets there, after the work queued ahead of it (the neighbour's data cannot arrive
before this stage's GPU asks for it). On a GPU the wait is on the device: a kernel that spins for that long
(``torch.cuda._sleep``, its clock rate measured once), the way an NCCL receive kernel spins on its flag, so the
host queues on and never synchronizes in the training loop. On a CPU the host is the device: it sleeps, then
spins the last ``SPIN_S`` for accuracy. Each wait's length is the modelled one times a factor drawn from a
lognormal distribution with mean 1 and coefficient of variation ``wait_jitter`` (a neighbour's data arriving
early or late; seeded, so runs repeat). Sends cost ``send_s`` on the device (a transfer occupies it; the
benchmark derives it from the activation's bytes and a link bandwidth), and the pipeline model counts them in
every stage's time. The lengths come from ``gpubench.pipeline_model`` with this device's forward and backward
times, measured in a calibration pass.

The waits are fixed lengths. A stage slowed down by a fill job does not delay its emulated neighbours, so
its slowdown shows fully in its own iteration time and is not partly hidden in a shorter wait, as it
would be in a real pipeline where this stage is not on the critical path. We expect the measured slowdown
to err high for that reason; no comparison with a real pipeline has been made.

Everything is seeded, so two emulators built with the same arguments compute bit-identical losses (the
hook must not change them). ``torch.cuda`` is touched only through ``CudaOps``, and only for a CUDA device.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpubench.pipeline_model import PipelineWaits, StageWaits, simulate_pipeline

SPIN_S = 0.0002  # the last part of a wait is spun, not slept: sleep wakes up late by tens of microseconds
CLOCK_CALIBRATION_CYCLES = 20_000_000  # a spin kernel this long (about 10 ms at 2 GHz) measures the GPU's clock
CLOCK_CALIBRATION_ROUNDS = 3  # ... this many times, the fastest kept: an idle GPU's clock ramps up under the first
POOL = 4  # distinct synthetic micro-batches cycled through (generating data is not what is measured)


# ----------------------------------------------------------------------------------------------------
# The device interface: what the emulator needs of an accelerator (a fake stands in for CUDA in tests)


class DeviceOps:
    """The host is the device (CPU): nothing is queued, so there is nothing to wait for; host clock."""

    name = "cpu"

    def time_s(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` and return how long its work took on the device, in seconds."""
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def idle(self, seconds: float, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
        """Hold the device for ``seconds`` after the work queued ahead: here the host, which sleeps, then spins
        the last ``SPIN_S`` (sleep wakes up late)."""
        deadline = clock() + seconds
        nap = seconds - SPIN_S
        if nap > 0:
            sleep(nap)
        while clock() < deadline:
            pass


class CudaOps(DeviceOps):
    """CUDA: waits as spin kernels, time with CUDA events. ``cuda`` is ``torch.cuda`` or a stand-in."""

    name = "cuda"

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self.cuda = torch.cuda if cuda is None else cuda
        self.cycles_per_s: float | None = None  # the spin kernel's clock, measured at the first idle

    def idle(self, seconds: float, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
        """Queue a kernel that spins ``seconds`` on the device (after the work queued ahead of it, in stream
        order); the host returns at once."""
        if self.cycles_per_s is None:
            # The spin counts SM clock cycles, and an idle GPU's clock is low until work ramps it up (on an H100,
            # 345 MHz idle, 1980 MHz under load): measured once, a 12 ms wait spun 6.9 ms there. The fastest of a
            # few rounds is the clock under load, which the training keeps up.
            took = min(self.time_s(lambda: self.cuda._sleep(CLOCK_CALIBRATION_CYCLES))
                       for _ in range(CLOCK_CALIBRATION_ROUNDS))
            if not took > 0:
                raise RuntimeError(f"a {CLOCK_CALIBRATION_CYCLES}-cycle spin kernel took {took} s on {self.device}: "
                                   "cannot model waits on this device")
            self.cycles_per_s = CLOCK_CALIBRATION_CYCLES / took
        self.cuda._sleep(max(1, round(seconds * self.cycles_per_s)))

    def time_s(self, fn: Callable[[], Any]) -> float:
        start = self.cuda.Event(enable_timing=True)
        end = self.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def device_ops(device: torch.device) -> DeviceOps:
    return CudaOps(device) if device.type == "cuda" else DeviceOps()


# ----------------------------------------------------------------------------------------------------
# The stage's model


@dataclass(frozen=True)
class StageShape:
    """Size of the emulated stage: its transformer blocks and one micro-batch."""

    hidden: int = 4096
    heads: int = 32
    ffn_mult: int = 4
    seq: int = 2048
    micro_batch: int = 1
    blocks: int = 4

    def problems(self) -> list[str]:
        """Every problem with the shape, each saying what to do."""
        out = []
        for name in ("hidden", "heads", "ffn_mult", "seq", "micro_batch", "blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"--{name.replace('_', '-')} {v}: must be an integer >= 1")
        if not out and self.hidden % self.heads:
            out.append(f"--hidden {self.hidden} is not divisible by --heads {self.heads}: "
                       "choose a width that is a multiple of the head count")
        return out

    def forward_flops(self) -> float:
        """FLOPs of one micro-batch's forward pass (matmuls and attention; causal attention counted whole)."""
        b, s, h = self.micro_batch, self.seq, self.hidden
        per_block = 2 * b * s * h * (4 * h + 2 * self.ffn_mult * h) + 4 * b * s * s * h
        return float(self.blocks * per_block)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, hidden: int, heads: int, ffn_mult: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_mult * hidden)
        self.fc2 = nn.Linear(ffn_mult * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def deepspeed_instruction_map() -> dict[type, Callable[..., Any]]:
    """DeepSpeed's instruction classes -> the emulator's handlers (the shape of ``PipelineEngine``'s map)."""
    from deepspeed.runtime.pipe import schedule

    return {
        schedule.OptimizerStep: _exec_optimizer_step,
        schedule.ReduceGrads: _exec_nothing,
        schedule.ReduceTiedGrads: _exec_nothing,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send,
        schedule.RecvGrad: _exec_recv_grads,
    }


def deepspeed_streams(stages: int, microbatches: int) -> list[list[str]]:
    """The instruction names DeepSpeed's ``TrainSchedule`` makes each stage execute, for pipeline_model."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    from bubbles.training.hook import instruction_stream

    return [instruction_stream(TrainSchedule(micro_batches=microbatches, stages=stages, stage_id=s))
            for s in range(stages)]


# ----------------------------------------------------------------------------------------------------
# The engine look-alike


class StageEmulator:
    """Stage ``stage_id`` of a ``num_stages``-stage 1F1B pipeline: real compute here, modelled waits.

    ``waits_s`` maps positions in the stage's instruction stream (receives) to the seconds the stage waits
    there; ``loss_broadcast_s`` is the end-of-batch wait. Both default to no waits and are usually set with
    ``set_waits`` from ``pipeline_model`` after ``calibrate``.
    """

    def __init__(self, *, stage_id: int, num_stages: int, micro_batches: int, shape: StageShape,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None, seed: int = 1234,
                 ops: DeviceOps | None = None, lr: float = 1e-4,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter,
                 wait_jitter: float = 0.0, send_s: float = 0.0) -> None:
        problems = shape.problems()
        if num_stages < 2:
            problems.append(f"num_stages {num_stages}: a pipeline has at least 2 stages")
        if not 0 <= stage_id < max(num_stages, 1):
            problems.append(f"stage {stage_id} is not one of the pipeline's {num_stages} stages "
                            f"(0..{num_stages - 1})")
        if micro_batches < 1:
            problems.append(f"micro_batches {micro_batches}: use 1 or more")
        if not (isinstance(wait_jitter, int | float) and math.isfinite(wait_jitter) and 0 <= wait_jitter <= 2):
            problems.append(f"wait jitter {wait_jitter!r}: a coefficient of variation from 0 (none) to 2")
        if not (isinstance(send_s, int | float) and math.isfinite(send_s) and send_s >= 0):
            problems.append(f"send time {send_s!r}: seconds >= 0")
        if problems:
            raise ValueError("; ".join(problems))
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.micro_batches = micro_batches
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda"
                                                      else torch.float32)
        self.ops = ops if ops is not None else device_ops(self.device)
        self.sleep = sleep
        self.clock = clock
        self.global_steps = 0
        self.waits_s: dict[int, float] = {}
        self.loss_broadcast_s = 0.0
        self.send_s = float(send_s)
        # Lognormal with mean 1 and coefficient of variation wait_jitter: sigma^2 = ln(1 + cv^2), mu = -sigma^2/2.
        self.wait_jitter = float(wait_jitter)
        self._jitter_sigma = math.sqrt(math.log1p(self.wait_jitter ** 2))
        self.seed = seed
        self._jitter = random.Random(seed + 2)
        # DeepSpeed's attribute name and shape: the hook wraps a copy of it per instance, as on a real engine.
        self._INSTRUCTION_MAP = deepspeed_instruction_map()

        torch.manual_seed(seed)
        self.module = nn.Sequential(*[TransformerBlock(shape.hidden, shape.heads, shape.ffn_mult)
                                      for _ in range(shape.blocks)]).to(device=self.device, dtype=self.dtype)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + 1)
        size = (shape.micro_batch, shape.seq, shape.hidden)

        def pool(scale: float) -> list[torch.Tensor]:
            return [(scale * torch.randn(size, generator=g)).to(device=self.device, dtype=self.dtype)
                    for _ in range(POOL)]

        self._inputs, self._targets, self._grads = pool(1.0), pool(1.0), pool(1e-3)
        self._reset_batch()

    # -- what the hook and the benchmark call ---------------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_waits(self, stage: StageWaits) -> None:
        """Use a modelled stage's waits (its stream must be this stage's)."""
        mine = self.stream()
        if tuple(stage.stream) != tuple(mine):
            raise ValueError(f"the modelled stream ({len(stage.stream)} instructions) is not this stage's "
                             f"TrainSchedule ({len(mine)}): model the same stage, stages and micro-batches")
        self.waits_s = {pos: s for pos, s in stage.waits_s.items() if pos < len(stage.stream)}
        self.loss_broadcast_s = stage.loss_broadcast_s

    def stream(self) -> list[str]:
        from deepspeed.runtime.pipe.schedule import TrainSchedule

        from bubbles.training.hook import instruction_stream

        return instruction_stream(TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                                stage_id=self.stage_id))

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One batch of DeepSpeed's TrainSchedule for this stage; returns the batch's mean loss (a tensor)."""
        from deepspeed.runtime.pipe.schedule import TrainSchedule

        self.module.train()
        self._exec_schedule(TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                          stage_id=self.stage_id))
        with torch.no_grad():
            loss = self._aggregate_total_loss()
        self.global_steps += 1
        return loss

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the benchmark emulates training only (TrainSchedule)")

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        """As ``PipelineEngine._exec_schedule``: look each instruction up in ``self._INSTRUCTION_MAP``."""
        self._reset_batch()
        position = 0
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
                self._position = position
                MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)
                position += 1
        self._position = position

    def _aggregate_total_loss(self) -> torch.Tensor:
        """The end-of-batch loss broadcast: wait its modelled length, return the batch's mean loss."""
        self._wait(self.loss_broadcast_s)
        return self._total_loss / self.micro_batches

    # -- calibration ------------------------------------------------------------------------------------------

    def calibrate(self, steps: int = 5, warmup: int = 2) -> tuple[float, float]:
        """Median device time of one micro-batch's forward and backward pass over ``steps`` timed ones.

        Leaves no gradient behind (the training then starts from the same state with or without a hook).
        """
        if steps < 1 or warmup < 0:
            raise ValueError(f"calibration needs steps >= 1 and warmup >= 0, got {steps} and {warmup}")
        fwd, bwd = [], []
        for i in range(warmup + steps):
            x = self._inputs[i % POOL]
            if not self.is_first_stage:  # as in the run: a received activation needs its gradient
                x = x.detach().requires_grad_(True)
            out: list[torch.Tensor] = []
            grad = self._grads[i % POOL]

            def forward(x: torch.Tensor = x, out: list[torch.Tensor] = out) -> None:
                out.append(self._forward(x))

            def backward(out: list[torch.Tensor] = out, grad: torch.Tensor = grad) -> None:
                self._backward(out[0], grad)

            tf = self.ops.time_s(forward)
            tb = self.ops.time_s(backward)
            if i >= warmup:
                fwd.append(tf)
                bwd.append(tb)
        self.optimizer.zero_grad(set_to_none=True)
        return statistics.median(fwd), statistics.median(bwd)

    def model_waits(self, forward_s: float, backward_s: float, p2p_latency_s: float = 0.0) -> PipelineWaits:
        """Model the whole pipeline with these pass times and take this stage's waits."""
        waits = simulate_pipeline(deepspeed_streams(self.num_stages, self.micro_batches),
                                  microbatches=self.micro_batches, p2p_latency_s=p2p_latency_s,
                                  durations_s={"ForwardPass": forward_s, "BackwardPass": backward_s,
                                               "SendActivation": self.send_s, "SendGrad": self.send_s})
        self.set_waits(waits.stage(self.stage_id))
        return waits

    # -- internals --------------------------------------------------------------------------------------------

    def _reset_batch(self) -> None:
        self._position = 0
        self._inputs_of: dict[int, torch.Tensor] = {}
        self._outputs_of: dict[int, torch.Tensor] = {}
        self._losses_of: dict[int, torch.Tensor] = {}
        self._grads_of: dict[int, torch.Tensor] = {}
        self._total_loss = torch.zeros((), device=self.device, dtype=torch.float32)
        self._micro = 0

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def _backward(self, out: torch.Tensor, grad: torch.Tensor | None, loss: torch.Tensor | None = None) -> None:
        if loss is not None:
            (loss / self.micro_batches).backward()
        else:
            out.backward(grad)

    def _next_sample(self) -> int:
        k = (self.global_steps * self.micro_batches + self._micro) % POOL
        self._micro += 1
        return k

    def pair_waits(self, *key: int) -> None:
        """Draw the waits' jitter from here on from a stream of its own, keyed by ``key`` (the benchmark's training
        passes the round and the iteration's index in its phase): iterations given the same key wait alike, so a
        comparison of two phases is not blurred by the modelled jitter (common random numbers). Seeded as the rest:
        the same seed and key draw the same waits on every run."""
        self._jitter = random.Random(f"{self.seed}:" + ":".join(str(k) for k in key))

    def _wait(self, seconds: float) -> None:
        """A receive: once the device gets here, it waits ``seconds`` times this wait's jitter."""
        if seconds <= 0:
            return
        if self.wait_jitter:
            sigma = self._jitter_sigma
            seconds *= self._jitter.lognormvariate(-sigma * sigma / 2, sigma)
        self.ops.idle(seconds, self.sleep, self.clock)

    def _send(self) -> None:
        if self.send_s > 0:
            self.ops.idle(self.send_s, self.sleep, self.clock)


# Handlers: called as handler(engine, **cmd.kwargs), like PipelineEngine's (DeepSpeed binds them with MethodType).


def _exec_nothing(self: StageEmulator, **kwargs: Any) -> None:
    """Gradient reductions: nothing to do on one device."""


def _exec_send(self: StageEmulator, **kwargs: Any) -> None:
    """A send: the transfer occupies the device for ``send_s``."""
    self._send()


def _exec_load_micro_batch(self: StageEmulator, buffer_id: int) -> None:
    if self.is_first_stage:
        self._inputs_of[buffer_id] = self._inputs[self._next_sample()]


def _exec_recv_activations(self: StageEmulator, buffer_id: int) -> None:
    self._wait(self.waits_s.get(self._position, 0.0))
    # A received activation needs its gradient: the previous stage's backward starts from it.
    self._inputs_of[buffer_id] = self._inputs[self._next_sample()].detach().requires_grad_(True)


def _exec_forward_pass(self: StageEmulator, buffer_id: int) -> None:
    x = self._inputs_of.pop(buffer_id)
    out = self._forward(x)
    target = self._targets[(self.global_steps * self.micro_batches + buffer_id) % POOL]
    if self.is_last_stage:  # the loss is where this stage's backward starts
        loss = F.mse_loss(out.float(), target.float())
        self._losses_of[buffer_id] = loss
    else:  # a loss of the output only to report (and to check the hook leaves it bit-identical)
        with torch.no_grad():
            loss = F.mse_loss(out.detach().float(), target.float())
    self._outputs_of[buffer_id] = out
    self._total_loss = self._total_loss + loss.detach()


def _exec_recv_grads(self: StageEmulator, buffer_id: int) -> None:
    self._wait(self.waits_s.get(self._position, 0.0))
    self._grads_of[buffer_id] = self._grads[(self.global_steps + buffer_id) % POOL]


def _exec_backward_pass(self: StageEmulator, buffer_id: int) -> None:
    out = self._outputs_of.pop(buffer_id)
    if self.is_last_stage:
        self._backward(out, None, self._losses_of.pop(buffer_id))
    else:
        self._backward(out, self._grads_of.pop(buffer_id))


def _exec_optimizer_step(self: StageEmulator, **kwargs: Any) -> None:
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)


def modelled_summary(waits: PipelineWaits, stage: int, forward_s: float, backward_s: float) -> dict[str, Any]:
    """What the benchmark reports about the pipeline it emulates (JSON-ready)."""
    st = waits.stage(stage)
    p, m = len(waits.stages), waits.microbatches
    return {
        "forward_s": forward_s, "backward_s": backward_s,
        "iteration_s": st.iteration_s, "wait_s": st.wait_s, "bubble_share": st.bubble_share,
        "ideal_bubble_share": (p - 1) / (m + p - 1),
        "waits_s": {str(k): v for k, v in sorted(st.waits_s.items()) if v > 0},
        "converged": waits.converged,
    }
