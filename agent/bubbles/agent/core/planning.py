"""What a fill job's plan says it will run per iteration, and how that compares with what ran: pure.

The plan is ``bubbles.core.plan.plan_rate`` over the stage's bubbles (each slot's predicted length: the hook's recent
predictions, the profile's until then), the job's step times and the fill process's signal latency. It is made with
what is known: the spec's step time, then the runtime's profile, then the steps' own times once enough have run in
bubbles (as ``StepGates`` learns them). ``PlanWatch`` keeps, per job, the steps and bubbles of its recent iterations;
every ``PLAN_CHECK_ITERATIONS`` it compares the plan in force with what ran and, where the two are more than
``PLAN_FACTOR`` apart, says why, then plans again with what it measured.

Why a plan was off is found by replacing each input the plan was made with by what was measured since, one at a
time, and naming the one that moves the plan furthest towards what ran (the step time, the bubbles' predicted
lengths, the signal latency); what the plan does not model is checked first: the slowdown guard withholding bubbles,
bubbles ending before their predicted end, no bubble fitting a first step, steps started past the prediction.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bubbles.core.cycle import BubbleCycle
from bubbles.core.plan import RatePlan, StepTime, plan_rate, predicted_lengths
from bubbles.core.stats import percentile

# The stated factor: what ran is within PLAN_FACTOR of the plan either way, or within PLAN_SLACK_STEPS steps per
# iteration of it (a plan of 0.2 steps against 0.6 is no error worth a reason); otherwise ``plan_reason`` says why.
PLAN_FACTOR = 2.0
PLAN_SLACK_STEPS = 0.5
PLAN_MIN_ITERATIONS = 8  # iterations of the stage, the job serving, before the first comparison
PLAN_CHECK_ITERATIONS = 8  # and between comparisons
PLAN_WINDOW_ITERATIONS = 32  # what ran: over the last this many
STEP_WINDOW = 32  # step durations kept per size and place (as StepGates' window)
MIN_GATE_SAMPLES = 8  # durations before a gate is measured (as StepGates' min_samples)
MIN_TIME_SAMPLES = 3  # durations before a typical duration is taken from them
LENGTH_WINDOW = 32  # predicted lengths kept per slot (as the hook's RecentLengths)
LAG_WINDOW = 64
_LAG_CAP_NS = 1_000_000_000  # a START read later than this after its stamp is a stall or a wrong clock, not latency
_WITHHELD = 0.25  # guard: the share of bubbles it withheld, or 1 - the mean share it gave, beyond which it is named
_EARLY = 0.25  # bubbles ending before their predicted end: the share beyond which that is named
_TAIL = 0.3  # steps started past the predicted end: the share of the steps beyond which that is named
_MOVED = math.log(1.25)  # an input is named when replacing it moves the plan at least this much towards what ran

BASIS_WORDS = {"spec": "in the spec", "profile": "in the fill job's profile at init",
               "measured": "measured before"}


def within_factor(planned: float, ran: float) -> bool:
    """Whether ``ran`` is what ``planned`` said, within the stated factor (see ``PLAN_FACTOR``)."""
    if abs(ran - planned) <= PLAN_SLACK_STEPS:
        return True
    return planned > 0 and ran > 0 and 1 / PLAN_FACTOR <= ran / planned <= PLAN_FACTOR


def median_ns(values: Sequence[int]) -> float:
    return percentile(values, 50)


def mean_ns(values: Sequence[int]) -> float:
    return sum(values) / len(values)


def slot_predictions(cycle: BubbleCycle, recent: dict[int, deque[int]]) -> tuple[tuple[float, ...], ...]:
    """Each slot's predicted lengths in seconds: the hook's recent predictions for it, else the profile's one."""
    profiled = predicted_lengths(cycle)
    return tuple(tuple(ns / 1e9 for ns in recent[s.slot]) if recent.get(s.slot) else (profiled[i],)
                 for i, s in enumerate(cycle.slots))


def start_lag_s(lags: Sequence[int]) -> float:
    """The agent's own lag in reading a bubble's START (its median), the prior for a fill process's latency."""
    return median_ns(lags) / 1e9 if lags else 0.0


def start_lag(lag_ns: int) -> int | None:
    """A START's lag as kept (None: not a latency)."""
    return lag_ns if 0 <= lag_ns <= _LAG_CAP_NS else None


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is made of."""

    predicted_s: tuple[tuple[float, ...], ...]  # each bubble of the cycle's predicted lengths (recent ones)
    steps: tuple[StepTime, ...]  # smallest size first
    latency_s: float  # from a bubble's signal to its first step's start
    basis: str  # where the step times come from: "spec", "profile" (the runtime's at init) or "measured"

    def rate(self, share: float = 1.0) -> RatePlan:
        return plan_rate(self.predicted_s, self.steps, self.latency_s, share)


@dataclass(frozen=True)
class PlanCheck:
    """One comparison of a plan with what ran."""

    planned: float  # steps per iteration the plan in force said
    ran: float  # steps per iteration that ran, over ``iterations``
    iterations: float
    basis: str  # of the plan compared
    reason: str  # "" when within the stated factor; else why not
    replanned: float  # the plan in force from now on (made with what was measured)
    replanned_basis: str

    @property
    def ratio(self) -> float | None:
        """ran / planned; None when the plan was 0."""
        return self.ran / self.planned if self.planned > 0 else None


@dataclass(frozen=True)
class _Bubble:
    seq: int
    predicted_ns: int
    length_ns: int
    offered: bool  # the job was armed in it (not withheld by the slowdown guard)
    share: float  # of it given to fill work


class PlanWatch:
    """One fill job's plan: its inputs as they are learnt, the plan in force, and its comparisons with what ran."""

    def __init__(self, spec_step_s: float | None) -> None:
        self.spec_step_s = spec_step_s
        self.reported: tuple[tuple[int | None, float], ...] = ()  # the runtime's first-step gates, by size
        self._durations: dict[tuple[int | None, bool], deque[int]] = {}  # (size, first in its bubble) -> ns
        self._offsets: deque[int] = deque(maxlen=LAG_WINDOW)  # a first step's start after its bubble's signal
        self._last_seq: int | None = None
        self._steps: dict[int, list[int]] = {}  # bubble seq -> [steps, of which past the predicted end, their ns]
        self._bubbles: deque[_Bubble] = deque()
        self._since_check = 0
        self.inputs: PlanInputs | None = None  # the plan in force
        self.planned: RatePlan | None = None
        self.last: PlanCheck | None = None

    # -- inputs -------------------------------------------------------------------------------------------------
    def reported_times(self, step_s: float, sizes: Sequence[Sequence[float]]) -> None:
        """The runtime's ``profile``: a bubble's first step's gate, by size where the job has sizes."""
        if sizes:
            self.reported = tuple((int(size), float(t)) for size, t in sizes)
        else:
            self.reported = ((None, float(step_s)),)
        for size, t in self.reported:
            # A bubble's first step's gate reported at or below the 75th percentile of the durations measured here
            # (a gate is their 90th): the runtime forgot its slower half (its gate had refused bubbles its median
            # fitted, StepGates.refused); the plan forgets them too, or it would stay at what no longer gates the job.
            first = self._durations.get((size, True))
            if first and len(first) >= MIN_GATE_SAMPLES and t * 1e9 <= percentile(first, 75):
                self._durations[(size, True)] = deque((d for d in first if d <= t * 1e9), maxlen=STEP_WINDOW)

    def step(self, seq: int, size: int | None, start_ns: int, end_ns: int, signal_ns: int, tail: bool) -> None:
        """A step the job ran in bubble ``seq`` (harvest mode), in the order the job reported them."""
        first = seq != self._last_seq
        self._last_seq = seq
        if end_ns > start_ns:
            self._durations.setdefault((size, first), deque(maxlen=STEP_WINDOW)).append(end_ns - start_ns)
        if first and not tail and 0 < signal_ns <= start_ns:
            lag = start_lag(start_ns - signal_ns)
            if lag is not None:
                self._offsets.append(lag)
        counts = self._steps.setdefault(seq, [0, 0, 0])
        counts[0] += 1
        counts[1] += tail
        counts[2] += max(0, end_ns - start_ns)

    def bubble(self, seq: int, predicted_ns: int, length_ns: int, offered: bool, share: float, slots: int) -> None:
        """A bubble of the job's stage ended while the job served it (armed, or withheld by the guard)."""
        self._bubbles.append(_Bubble(seq, max(0, predicted_ns), max(0, length_ns), offered, share))
        keep = PLAN_WINDOW_ITERATIONS * max(1, slots)
        while len(self._bubbles) > keep:
            self._bubbles.popleft()
        oldest = self._bubbles[0].seq
        if len(self._steps) > 2 * keep:  # steps of bubbles that never ended here (an END lost) go too
            self._steps = {s: c for s, c in self._steps.items() if s >= oldest}
        self._since_check += 1

    # -- what is known --------------------------------------------------------------------------------------------
    def step_times(self) -> tuple[tuple[StepTime, ...], str] | None:
        """Each size's gates and typical durations, and their basis; None while no step time is known.

        As the runtime's ``StepGates``: a gate is the 90th percentile of the size's last durations there (a bubble's
        first step, or a later one) once ``MIN_GATE_SAMPLES`` have run, never below the spec's step time for the
        largest size, else what the runtime reported (the profile's, or the spec's). A step then takes its mean
        duration there: how many steps fit a bubble follows the mean (a few slow steps cost what they take), not the
        median."""
        sizes = self.reported or (((None, self.spec_step_s),) if self.spec_step_s else ())
        if not sizes:
            return None
        out = []
        measured = False
        for i, (size, gate) in enumerate(sizes):
            floor = (self.spec_step_s or 0.0) if i == len(sizes) - 1 else 0.0  # as the runtime's floors
            first = self._durations.get((size, True), deque())
            later = self._durations.get((size, False), deque())
            first_gate = max(percentile(first, 90) / 1e9, floor) if len(first) >= MIN_GATE_SAMPLES else gate
            later_gate = max(percentile(later, 90) / 1e9, floor) if len(later) >= MIN_GATE_SAMPLES else first_gate
            first_s = mean_ns(first) / 1e9 if len(first) >= MIN_TIME_SAMPLES else first_gate
            later_s = (mean_ns(later) / 1e9 if len(later) >= MIN_TIME_SAMPLES
                       else first_s if len(first) >= MIN_TIME_SAMPLES else later_gate)
            measured |= len(first) >= MIN_GATE_SAMPLES
            out.append(StepTime(first_gate, later_gate, first_s, later_s, size))
        return tuple(out), "measured" if measured else "profile" if self.reported else "spec"

    def latency_s(self, prior_s: float) -> float:
        """A first step's start after its bubble's signal (the mean): measured once a few have run, else
        ``prior_s``."""
        return mean_ns(self._offsets) / 1e9 if len(self._offsets) >= MIN_TIME_SAMPLES else prior_s

    def inputs_now(self, predicted_s: tuple[tuple[float, ...], ...], prior_latency_s: float) -> PlanInputs | None:
        times = self.step_times()
        if times is None or not predicted_s:
            return None
        return PlanInputs(predicted_s, times[0], self.latency_s(prior_latency_s), times[1])

    # -- decisions ------------------------------------------------------------------------------------------------
    def make(self, predicted_s: tuple[tuple[float, ...], ...], prior_latency_s: float) -> RatePlan | None:
        """Put in force a plan made with what is known now; None while no step time is known."""
        inputs = self.inputs_now(predicted_s, prior_latency_s)
        if inputs is None:
            return None
        self.inputs, self.planned = inputs, inputs.rate()
        return self.planned

    def due(self, slots: int) -> bool:
        """Whether a comparison is due: enough iterations in the window, and since the last one."""
        slots = max(1, slots)
        return (len(self._bubbles) >= PLAN_MIN_ITERATIONS * slots
                and self._since_check >= PLAN_CHECK_ITERATIONS * slots)

    def check(self, predicted_s: tuple[tuple[float, ...], ...], prior_latency_s: float, slots: int) -> PlanCheck | None:
        """Compare the plan in force with what ran over the window, say why where it is off, and plan again with
        what was measured. None while there is no plan (no step time known) or no window."""
        self._since_check = 0
        if self.inputs is None or self.planned is None:
            self.make(predicted_s, prior_latency_s)
        measured = self.inputs_now(predicted_s, prior_latency_s)
        if self.inputs is None or self.planned is None or measured is None or not self._bubbles:
            return None
        iterations = len(self._bubbles) / max(1, slots)
        counts = [self._steps.get(b.seq, (0, 0, 0)) for b in self._bubbles]
        steps, tails = sum(c[0] for c in counts), sum(c[1] for c in counts)
        took_s = sum(c[2] for c in counts) / steps / 1e9 if steps else 0.0
        planned = self.planned.steps_per_iteration
        ran = steps / iterations
        reason = "" if within_factor(planned, ran) else self._why(planned, ran, measured, steps, tails, took_s)
        basis = self.inputs.basis
        self.inputs, self.planned = measured, measured.rate()
        self.last = PlanCheck(planned, ran, iterations, basis, reason, self.planned.steps_per_iteration,
                              measured.basis)
        return self.last

    def _why(self, planned: float, ran: float, measured: PlanInputs, steps: int, tails: int, took_s: float) -> str:
        """Why ``ran`` is more than the stated factor from ``planned`` (see the module's documentation)."""
        assert self.inputs is not None
        old = self.inputs
        window = list(self._bubbles)
        if ran < planned:
            now = measured.rate()
            if now.steps_per_iteration == 0:
                return (f"no bubble fits a first step: one needs {now.first_need_s * 1e3:.2f} ms of a bubble's "
                        f"predicted length (its gate after {measured.latency_s * 1e3:.2f} ms of signal latency), the "
                        f"longest is {now.longest_s * 1e3:.2f} ms")
            offered = [b for b in window if b.offered]
            withheld = 1 - len(offered) / len(window)
            share = sum(b.share for b in offered) / len(offered) if offered else 0.0
            if withheld > _WITHHELD or share < 1 - _WITHHELD:
                return (f"guard withheld: the slowdown guard paused fill work in {withheld:.0%} of the job's bubbles "
                        f"and gave it {share:.0%} of the others")
            early = sum(1 for b in offered if b.length_ns < b.predicted_ns) / len(offered)
            if early > _EARLY:
                return (f"bubbles shorter than predicted: {early:.0%} of the job's bubbles ended before their "
                        "predicted end")
        elif steps and tails / steps > _TAIL:
            return (f"steps past the predicted end: {tails} of the {steps} steps that ran started after their bubble's "
                    "predicted end (the fill job's tail risk), which the plan does not count")
        candidates = {
            "step": replace(old, steps=measured.steps),
            "bubbles": replace(old, predicted_s=measured.predicted_s),
            "latency": replace(old, latency_s=measured.latency_s),
        }

        def distance(x: float) -> float:
            return abs(math.log(max(x, 0.05) / max(ran, 0.05)))

        moved = {k: distance(planned) - distance(v.rate().steps_per_iteration) for k, v in candidates.items()}
        best = max(moved, key=lambda k: moved[k])
        if moved[best] >= _MOVED:
            if best == "step":
                size = self._most_run_size(measured.steps)
                m = next(st for st in measured.steps if st.size == size)
                p = next((st for st in old.steps if st.size == size), old.steps[0])
                of = f" (size {size})" if size is not None else ""
                parts = sorted([("a bubble's first step", m.first_s, p.first_s), ("later steps", m.later_s, p.later_s)],
                               key=lambda x: -abs(math.log(x[1] / x[2])))
                (w1, m1, p1), (w2, m2, p2) = parts
                return (f"step time{of}: {w1} {m1 * 1e3:.2f} ms measured vs {p1 * 1e3:.2f} ms "
                        f"{BASIS_WORDS[old.basis]}; {w2} {m2 * 1e3:.2f} ms vs {p2 * 1e3:.2f} ms")
            if best == "bubbles":
                now_s, then_s = _per_iteration(measured.predicted_s), _per_iteration(old.predicted_s)
                word = "shorter" if now_s < then_s else "longer"
                return (f"bubbles {word} than predicted: their predicted lengths sum to {now_s * 1e3:.2f} ms per "
                        f"iteration now, {then_s * 1e3:.2f} ms when planned")
            return (f"signal latency: a bubble's first step started {measured.latency_s * 1e3:.2f} ms after its "
                    f"signal, {old.latency_s * 1e3:.2f} ms planned")
        longest = max(max(st.first_s, st.later_s) for st in old.steps)
        if ran < planned and took_s > 1.5 * longest:  # too few of any one size to measure it: all of them together
            return (f"step time: the {steps} steps that ran took {took_s * 1e3:.2f} ms on average, at most "
                    f"{longest * 1e3:.2f} ms {BASIS_WORDS[old.basis]} (too few of each size ran to measure it apart)")
        return (f"not explained by the step time, the bubbles' predicted lengths, the signal latency or the guard: "
                f"{steps} steps ran in {len(window)} bubbles, {sum(1 for b in window if b.offered)} of them offered, "
                f"{took_s * 1e3:.2f} ms a step on average")

    def _most_run_size(self, steps: tuple[StepTime, ...]) -> int | None:
        """The size of ``steps`` with the most durations measured (the smallest when none has any)."""
        def runs(size: int | None) -> int:
            return sum(len(self._durations.get((size, first), ())) for first in (True, False))
        return max((st.size for st in steps), key=runs, default=None) if any(
            runs(st.size) for st in steps) else steps[0].size


def _per_iteration(slots: tuple[tuple[float, ...], ...]) -> float:
    """The predicted bubble time of one iteration: each bubble's mean predicted length, summed."""
    return sum(sum(lengths) / len(lengths) for lengths in slots if lengths)
