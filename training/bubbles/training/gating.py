"""When a fill step may start: the fill runtime's gating decisions, pure (every time is given, nothing is read).

``StepGates``: how long a step of each size takes where it would run. FreeRide's program-directed limit starts a step
only if its gate fits before the bubble's predicted end, a low percentile of the bubble's past lengths
(``bubbles.core.cycle.predicted_length``), so that steps rarely outlive their bubbles.

``TailRisk``: what to do once a bubble has lasted past that prediction. Most bubbles do (by construction nine in
ten), and the time they have left went unused: 16-17% of the bubble time on the H100, 34% on the CPU demo
(docs/benchmarks.md). There a step may still start when the chance that it outlives the bubble, given how long the
bubble has lasted, is small.

``StartPredictor``: when the next bubble should start, for busy-polling around it.

``GangGate``: the bubbles a gang's GPUs share (a fill job over N GPUs of one stage, one process each), from the N
GPUs' signals.

``bubbles.training.sdk.runtime.FillRuntime`` is the shell that feeds them the signals and step times and runs what
they allow.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bubbles.core.stats import percentile


class StepGates:
    """How long a step of each size may be expected to take where it would run, kept current. Pure.

    Starts from the sizes' gates timed at init (FreeRide's profile, outside bubbles); once ``min_samples`` steps of
    a size have run at a place (a bubble's first step, or a later one), its gate there is the 90th percentile of
    its last ``window`` durations there. A bubble's first step pays for what the training evicted from the caches
    while it computed (about +1 ms a step on the CPU demo), so it is tracked apart; a gate from
    outside bubbles would let first steps overrun. Until later steps of a size have a gate of their own, the first
    steps' bounds theirs (see ``gate_ns``). ``size`` None: a job whose step takes no size. ``floors`` (seconds by
    size): gates never go below them (a step time the job's spec states).

    A measured gate learns only from steps it lets run, so a burst of slow steps (the machine busy for a few seconds)
    can lift it past every bubble for good: the job then sits at 0 steps while its executor stays taken (the cluster
    tier's operator-replacement test, 2026-12-07: a first step's 90th percentile crept past the longest bubble, and
    the job stalled at 629 of 1,500 steps). So a size's measured gate that refuses ``stale_after`` places in a row
    (``refused``) where its median would have fitted, with no step of it run meanwhile, forgets its slower half: the
    gate becomes the median, and the steps that run then re-measure it.
    """

    def __init__(self, profiled: Sequence[tuple[int | None, float]], *, window: int = 32,
                 min_samples: int = 8, floors: dict[int | None, float] | None = None,
                 stale_after: int = 32) -> None:
        if not profiled or window < 1 or not 1 <= min_samples <= window or stale_after < 1:
            raise ValueError("StepGates needs profiled gates, window >= 1, 1 <= min_samples <= window and "
                             "stale_after >= 1")
        self.stale_after = stale_after
        self._refused: dict[tuple[int | None, bool], int] = {}  # measured gates' refusals in a row (see refused)
        self.forgotten = 0  # times a size forgot its slower half
        self.sizes = [size for size, _ in profiled]  # smallest first
        self._profiled = {size: int(t * 1e9) for size, t in profiled}
        self._seen: dict[tuple[int | None, bool], list[int]] = {}
        self._gate: dict[tuple[int | None, bool], int] = {}
        self._floor = {size: int(t * 1e9) for size, t in (floors or {}).items()}
        self.window = window
        self.min_samples = min_samples

    def gate_ns(self, size: int | None, first: bool) -> int:
        gate = self._gate.get((size, first))
        if gate is not None:
            return gate
        if not first and (size, True) in self._gate:
            # No later step of this size has run yet, but first ones have: they are the slower kind, so their gate
            # bounds a later step's, and a profile inflated by an outlier at init (a later step's gate that never
            # fits, so never learns) gives way to what was seen in bubbles.
            return min(self._gate[(size, True)], self._profiled[size])
        return self._profiled[size]

    def observe(self, size: int | None, first: bool, duration_ns: int) -> None:
        self._refused.pop((size, first), None)
        seen = self._seen.setdefault((size, first), [])
        seen.append(duration_ns)
        if len(seen) > self.window:
            del seen[0]
        if len(seen) >= self.min_samples:
            self._gate[(size, first)] = max(int(percentile(seen, 90)), self._floor.get(size, 0))

    def refused(self, left_ns: int, first: bool) -> list[int | None]:
        """No size's gate fitted the ``left_ns`` a place offered (a bubble's first step, or a later one). Counts, for
        each size whose gate there is measured and whose recent median would have fitted, one refusal in a row;
        returns the sizes that reached ``stale_after`` and forgot their slower half (their gate is now the median,
        never below the floor)."""
        out: list[int | None] = []
        for size in self.sizes:
            key = (size, first)
            seen = self._seen.get(key, [])
            if key not in self._gate or len(seen) < self.min_samples or self._gate[key] <= left_ns:
                continue  # the profile's gate (the runtime's starvation fallback covers it), or one that fits
            median = int(percentile(seen, 50))
            if median > left_ns:
                continue  # too short even for the median: not the gate's tail (nor counted, nor a reset)
            n = self._refused[key] = self._refused.get(key, 0) + 1
            if n < self.stale_after:
                continue
            del self._refused[key]
            self._seen[key] = [d for d in seen if d <= median]
            self._gate[key] = max(median, self._floor.get(size, 0))
            self.forgotten += 1
            out.append(size)
        return out

    def durations_ns(self, size: int | None, first: bool) -> list[int]:
        """The step durations a size's gate stands for there: its recent ones once ``min_samples`` have run, else
        its gate alone (the profiled time, conservative: it carries the profile's margin)."""
        seen = self._seen.get((size, first), [])
        return list(seen) if len(seen) >= self.min_samples else [self.gate_ns(size, first)]

    def first_steps_s(self) -> list[tuple[int | None, float]]:
        """Each size's gate for a bubble's first step, in seconds: what a bubble must offer to be used at all."""
        return [(size, self.gate_ns(size, True) / 1e9) for size in self.sizes]

    def relax(self, profiled: Sequence[tuple[int | None, float]]) -> None:
        """Lower the sizes' profiled gates to ``profiled`` (seconds) where that is less. For a profile that fits no
        bubble: a gate no bubble fits lets no step run, so it never learns (the runtime's starvation fallback)."""
        for size, t in profiled:
            if size in self._profiled:
                self._profiled[size] = min(self._profiled[size], int(t * 1e9))

    def fitting(self, left_ns: int, first: bool) -> list[int | None]:
        """The sizes whose gate fits in ``left_ns``, smallest first (run the last); empty when none does."""
        return [size for size in self.sizes if self.gate_ns(size, first) <= left_ns]


class TailRisk:
    """Whether a step may start past its bubble's predicted end: the chance that the bubble, having lasted past the
    prediction, ends while a fill step runs. Pure.

    A bubble's length is random (its neighbour's compute and the network jitter). Once it has lasted ``a``, what is
    left of it follows the lengths of its slot's past bubbles that lasted longer than ``a`` (the survivors). The
    bound is per bubble, not per step: from the moment ``since`` the bubble entered its tail (the prediction first
    refused a step), a step of duration ``d`` may start at ``a`` if at most ``max_risk`` of the bubbles that lasted
    past ``since`` ended before ``a + d``. So of the bubbles whose tails are filled, at most that share (in the
    slot's recent lengths) end while a tail step runs, however many tail steps a bubble takes; ending between two
    of them counts too. Over the slot's last ``window`` lengths and the step's recent durations
    (``StepGates.durations_ns``), the share of (length, duration) pairs for which it would is the risk. With fewer
    than ``min_survivors`` survivors the tail is unknown and nothing starts there.

    A bubble whose end has not been read yet may have ended already: its END signal takes time to arrive. So the
    survivors are the lengths above ``since`` less the END signals' lag (the 90th percentile of the recent ones,
    ``end_lag``), and the lengths between the two count as overruns for any step.

    ``window`` is the hook's (``bubbles.core.cycle.RecentLengths``, 32), so the tail follows a change in the bubbles as
    fast as the prediction does.
    """

    def __init__(self, max_risk: float, *, window: int = 32, min_survivors: int = 8, lag_window: int = 64) -> None:
        if not 0.0 <= max_risk < 1.0:
            raise ValueError(f"TailRisk's max_risk is a probability below 1 (0 turns it off), got {max_risk!r}")
        if window < 1 or not 1 <= min_survivors <= window or lag_window < 1:
            raise ValueError("TailRisk needs window >= 1, 1 <= min_survivors <= window and lag_window >= 1")
        self.max_risk = max_risk
        self.window = window
        self.min_survivors = min_survivors
        self._order: dict[int, deque[int]] = {}  # slot -> its last lengths, oldest first
        self._sorted: dict[int, list[int]] = {}  # slot -> the same lengths, sorted
        self._lags: deque[int] = deque(maxlen=lag_window)
        self._lag_ns: int | None = 0  # their 90th percentile; None: to be computed (when a risk is asked for)

    def ended(self, slot: int, length_ns: int) -> None:
        """A bubble of ``slot`` lasted ``length_ns`` (from its START's stamp to its END's)."""
        if length_ns <= 0:
            return
        order = self._order.setdefault(slot, deque())
        ordered = self._sorted.setdefault(slot, [])
        order.append(length_ns)
        insort(ordered, length_ns)
        if len(order) > self.window:
            old = order.popleft()
            del ordered[bisect_left(ordered, old)]

    def end_lag(self, lag_ns: int) -> None:
        """An END signal was read ``lag_ns`` after its stamp (read at once, not after a step)."""
        self._lags.append(max(0, lag_ns))
        self._lag_ns = None  # not computed here: the END path stays light; most bubbles never ask for a risk

    @property
    def lag_ns(self) -> int:
        if self._lag_ns is None:
            self._lag_ns = int(percentile(list(self._lags), 90))
        return self._lag_ns

    def risk(self, slot: int, elapsed_ns: int, durations_ns: Sequence[int],
             since_ns: int | None = None) -> float | None:
        """The chance that a bubble of ``slot`` that lasted past ``since_ns`` (default: ``elapsed_ns``) ends before a
        step of one of ``durations_ns`` (equally likely) started at ``elapsed_ns`` does; None when too few of the
        slot's bubbles lasted that long to tell."""
        lengths = self._sorted.get(slot)
        if not lengths or not durations_ns:
            return None
        since = elapsed_ns if since_ns is None else min(since_ns, elapsed_ns)
        lo = bisect_right(lengths, since - self.lag_ns)  # the survivors are lengths[lo:]
        survivors = len(lengths) - lo
        if survivors < self.min_survivors:
            return None
        short = sum(max(0, bisect_left(lengths, elapsed_ns + d) - lo) for d in durations_ns)
        return short / (survivors * len(durations_ns))

    def fitting(self, slot: int, elapsed_ns: int, gates: StepGates, first: bool,
                since_ns: int | None = None) -> list[int | None]:
        """The sizes (smallest first, run the last) whose risk is at most ``max_risk``; empty when none is, when
        the risk is unknown or when the tail is off (``max_risk`` 0). ``since_ns``: when this bubble entered its
        tail (see the class). The scan stops at the first size that risks too much: a larger one is not tried past a
        smaller one refused (launch-bound, their durations differ by noise alone)."""
        if self.max_risk <= 0.0:
            return []
        out: list[int | None] = []
        for size in gates.sizes:
            r = self.risk(slot, elapsed_ns, gates.durations_ns(size, first), since_ns)
            if r is None or r > self.max_risk:
                break
            out.append(size)
        return out


class StartPredictor:
    """When the next bubble should start: each slot recurs once per iteration, so its next start is its last start
    plus the time between its last two. Pure (times are given); the runtime busy-polls around the prediction."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int | None]] = {}  # slot -> (last start, period or None)

    def started(self, slot: int, start_ns: int) -> None:
        prev = self._last.get(slot)
        period = start_ns - prev[0] if prev is not None and start_ns > prev[0] else None
        self._last[slot] = (start_ns, period if period is not None else (prev[1] if prev else None))

    def next_start(self, now_ns: int, slack_ns: int) -> int | None:
        """The earliest predicted start not more than ``slack_ns`` in the past; None without a prediction."""
        best = None
        for last, period in self._last.values():
            if not period:
                continue
            nxt = last + period
            if nxt < now_ns - slack_ns:  # missed (a skipped iteration): project forward
                nxt += ((now_ns - slack_ns - nxt) // period + 1) * period
            if best is None or nxt < best:
                best = nxt
        return best


@dataclass(frozen=True)
class SharedBubble:
    """A bubble of every GPU of a gang at once: from the last of their STARTs to the first of their ENDs.

    ``seq``: stream 0's (the process's own GPU's) number for it, what the agent's records of that GPU know it by.
    ``predicted_end_ns``: the earliest of the GPUs' predicted ends."""

    slot: int
    seq: int
    start_ns: int
    predicted_end_ns: int


class GangGate:
    """The bubbles a gang's ``size`` GPUs share, from each GPU's BUBBLE_START/BUBBLE_END signals (stream ``i``: the
    ``i``-th GPU, the process's own first). Pure: every time is a signal's stamp.

    The gang's processes do collectives with each other, so a step of one waits for the others': it may run only
    while every GPU of the gang is in a bubble. The GPUs are ranks of one stage and run one schedule, so their bubbles
    of a slot line up; the gang's bubble of a slot opens at the last of the N STARTs of that slot and closes at the
    first END among them, with the earliest predicted end. Bubbles are matched by slot, not by sequence number: each
    hook numbers only the bubbles it signals, and two ranks whose profiles differ (each profiles its own) number the
    same bubble differently.

    Each stream's bubble is its newest START until that START's END, the single-GPU runtime's rule
    (``FillRuntime._drain_signals``): a START supersedes the stream's open bubble (its END was lost), and an END of
    another number is stale. Once the gang's bubble has closed, every stream needs a new START before the next one
    opens, so a stream whose END was lost cannot join its stale bubble to the others' next one. A stream that never
    signals keeps the gate shut. With ``size`` 1 it is the single-GPU rule exactly.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"GangGate needs a gang of at least one GPU, got {size!r}")
        self.size = size
        self._open: list[tuple[int, int, int, int] | None] = [None] * size  # stream -> (slot, seq, start, end)
        self.shared: SharedBubble | None = None  # the gang's bubble while it is open

    def start(self, stream: int, slot: int, seq: int, start_ns: int, predicted_end_ns: int) -> SharedBubble | None:
        """A BUBBLE_START on ``stream``; the gang's bubble if this START opens it (the last of the N), else None. A
        START on a stream of the open gang's bubble supersedes that bubble (``shared`` is None then, or the new
        one)."""
        self._open[stream] = (slot, seq, start_ns, predicted_end_ns)
        self.shared = None
        opened = self._open
        if any(b is None or b[0] != slot for b in opened):
            return None
        own = opened[0]
        assert own is not None
        self.shared = SharedBubble(slot, own[1], max(b[2] for b in opened if b is not None),
                                   min(b[3] for b in opened if b is not None))
        return self.shared

    def end(self, stream: int, seq: int) -> SharedBubble | None:
        """A BUBBLE_END of bubble ``seq`` on ``stream``; the gang's bubble if this END closes it (the first of the
        N), else None (a stale END, or one of a bubble the gang's was not open in)."""
        mine = self._open[stream]
        if mine is None or mine[1] != seq:
            return None
        shared = self.shared
        if shared is None:
            self._open[stream] = None
            return None
        self.shared = None
        self._open = [None] * self.size  # every stream's bubble was part of it: spent
        return shared
