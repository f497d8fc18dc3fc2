"""When the training the agent serves has ended (``bubbles agent --exit-when-done``): pure, the time given.

The shell looks at each GPU's hook (every rank of every stage it serves), as files and processes tell it
(``HookFacts``): the hook's card (``hook.json``,
``bubbles.core.card``), which ``detach()`` removes; the card's lock (``hook.lock``), which the hook's process holds for
its life, so a training killed by SIGKILL leaves a card nobody holds; and the process the kernel named as the sender of
the GPU's datagrams. ``hook_state`` makes that a GPU's state, and ``TrainingEnd`` decides:

- a GPU *started* once its hook was seen live (its card held, or a datagram heard from it); a card left by an
  earlier run, whose lock is free, is not a start;
- the training *ended* once every GPU that started has been gone for ``ENDED_AFTER_S`` without a break and without a
  datagram: a rank between two iterations keeps its card and its lock, so it is never taken for gone; a rank the
  agent found later (discovered from its card) counts from then on;
- with a start timeout, the agent gives up (exit 1) when no GPU started within it of the agent's start.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bubbles.core.identity import GpuKey

ENDED_AFTER_S = 3.0  # every started stage gone this long (a restart within it is not an end)
WATCH_INTERVAL_S = 0.5  # how often the shell looks at the hooks


class HookState(enum.Enum):
    LIVE = "live"
    GONE = "gone"
    UNSEEN = "unseen"  # no card, and no process to look at: not started, or nothing to tell by


@dataclass(frozen=True)
class HookFacts:
    """What the shell found of one GPU's hook."""

    card: bool | None  # a card is there (True), none is (False), one is there but unreadable (None)
    lock_held: bool | None = None  # the card's lock: held, free, or not to be told (a card without one, no flock)
    sender_alive: bool | None = None  # the process that sent the stage's datagrams; None: none known


def hook_state(facts: HookFacts, had_card: bool) -> tuple[HookState, str]:
    """The stage's state from ``facts`` (``had_card``: a card was seen there before), and for GONE, why."""
    if facts.card is not False:
        if facts.lock_held is True:
            return HookState.LIVE, ""
        if facts.lock_held is False:
            return HookState.GONE, "its process is gone (its card is left, but nothing holds the card's lock)"
        if facts.sender_alive is False:
            return HookState.GONE, "its process is gone (the process that sent its signals has exited)"
        return HookState.LIVE, ""  # a card and nothing against it
    if had_card:
        return HookState.GONE, "its hook detached (its card was removed)"
    if facts.sender_alive is True:
        return HookState.LIVE, ""
    if facts.sender_alive is False:
        return HookState.GONE, "its process is gone (the process that sent its signals has exited; it left no card)"
    return HookState.UNSEEN, ""


@dataclass(frozen=True)
class Ending:
    """The agent's end: ``code`` its exit status (0: the training ended), ``reason`` in words."""

    code: int
    reason: str


@dataclass
class _Stage:
    had_card: bool = False
    started: bool = False
    gone_since_ns: int | None = None
    why: str = ""
    heard_ns: int | None = None


@dataclass
class TrainingEnd:
    """Decides when the training has ended (see the module's documentation); GPUs are known from their first
    ``heard`` or ``observe``."""

    training: str
    started_ns: int  # the agent's start: a start timeout counts from it
    start_timeout_s: float | None = None
    ended_after_s: float = ENDED_AFTER_S
    _gpus: dict[GpuKey, _Stage] = field(init=False, default_factory=dict)

    def heard(self, key: GpuKey, now_ns: int) -> None:
        """A datagram from the GPU's hook: it runs."""
        st = self._gpus.setdefault(key, _Stage())
        st.started = True
        st.heard_ns = now_ns
        st.gone_since_ns = None

    def observe(self, key: GpuKey, facts: HookFacts, now_ns: int) -> HookState:
        st = self._gpus.setdefault(key, _Stage())
        state, why = hook_state(facts, st.had_card)
        st.had_card |= facts.card is not False
        if state is HookState.LIVE:
            st.started = True
            st.gone_since_ns = None
        elif state is HookState.GONE and st.started and st.gone_since_ns is None:
            st.gone_since_ns, st.why = now_ns, why
        return state

    @property
    def started(self) -> bool:
        return any(st.started for st in self._gpus.values())

    def verdict(self, now_ns: int) -> Ending | None:
        """The end, once it has come; None until then."""
        started = [(k, st) for k, st in sorted(self._gpus.items()) if st.started]
        if not started:
            if self.start_timeout_s is not None and now_ns - self.started_ns >= self.start_timeout_s * 1e9:
                return Ending(1, f"no stage of training {self.training!r} started within {self.start_timeout_s:g} s "
                                 "(--start-timeout): is the training's run directory and name the agent's "
                                 "(--run-dir, --training; $BUBBLES_RUN_DIR, $BUBBLES_TRAINING in the training)?")
            return None
        after_ns = self.ended_after_s * 1e9
        for _, st in started:
            if st.gone_since_ns is None or now_ns - st.gone_since_ns < after_ns:
                return None
            if st.heard_ns is not None and now_ns - st.heard_ns < after_ns:
                return None
        whys = "; ".join(f"stage {k.stage} rank {k.rank}: {st.why}" for k, st in started)
        return Ending(0, f"training {self.training!r} ended: every GPU's hook is gone ({whys})")
