"""The check of what a stage's training process is to the node's MPS server: its states, typed, and the pure
decisions about when to ask.

Asked once the stage is profiled (its CUDA is initialized by then), and again for a new process or after an answer
that told nothing, at most every ``TRAINING_RECHECK_S``. The answer itself crosses the process boundary as text
(``bubbles.core.api.MPS_CLIENT``, ``"not a client: ..."``), and so does the state in the agent's status (``""``,
``"pending"``, ``"unknown"``): ``TrainingMembership.wire`` and ``from_wire`` convert at that edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from bubbles.core import control
from bubbles.core.api import MPS_CLIENT, IsolationState, IsolationStatus, known_membership

TRAINING_RECHECK_S = 30.0  # at most one check of a stage's training MPS membership in this many seconds


class MembershipCheck(enum.Enum):
    """Where the check of a stage's training process stands; the values are the agent status's words."""

    NOT_ASKED = ""  # not asked yet, or asked again (a new process, a check that could not be made)
    PENDING = "pending"  # a VerifyTraining is out
    UNKNOWN = "unknown"  # answered, but nothing could be told: asked again later
    ANSWERED = "answered"  # answered: the text is the answer (reported as it is, not as this value)


@dataclass(frozen=True)
class TrainingMembership:
    """A stage's training process's MPS membership as the core knows it: the check's state and, once answered,
    ``Isolation.training_membership``'s answer."""

    check: MembershipCheck
    answer: str = ""

    NOT_ASKED: ClassVar[TrainingMembership]
    PENDING: ClassVar[TrainingMembership]
    UNKNOWN: ClassVar[TrainingMembership]

    @classmethod
    def from_wire(cls, text: str) -> TrainingMembership:
        """The membership the agent's status reports as ``text``."""
        for check in (MembershipCheck.NOT_ASKED, MembershipCheck.PENDING, MembershipCheck.UNKNOWN):
            if text == check.value:
                return cls(check)
        return cls(MembershipCheck.ANSWERED, text)

    @classmethod
    def of_answer(cls, answer: str | None) -> TrainingMembership:
        """What an answer of ``Isolation.training_membership`` makes it: None (nothing can be told now) is unknown."""
        return cls.from_wire(answer or MembershipCheck.UNKNOWN.value)

    @property
    def wire(self) -> str:
        """As the agent's status reports it: the answer, or ``""``, ``"pending"``, ``"unknown"``."""
        return self.answer if self.check is MembershipCheck.ANSWERED else self.check.value

    @property
    def known(self) -> str:
        """The answer if it is one the operator understands (``bubbles.core.api.known_membership``), else ""."""
        return known_membership(self.wire)

    @property
    def is_client(self) -> bool:
        return self.wire == MPS_CLIENT

    @property
    def pending(self) -> bool:
        return self.check is MembershipCheck.PENDING

    @property
    def needs_asking(self) -> bool:
        """Not asked yet, or asked and nothing could be told."""
        return self.check in (MembershipCheck.NOT_ASKED, MembershipCheck.UNKNOWN)

    def for_new_process(self) -> TrainingMembership:
        """After the stage's training process changed: asked again, unless a check is under way (one at a time per
        stage; its answer, about the old process, is dropped when it comes and the new one asked then)."""
        return self if self.pending else TrainingMembership.NOT_ASKED


TrainingMembership.NOT_ASKED = TrainingMembership(MembershipCheck.NOT_ASKED)
TrainingMembership.PENDING = TrainingMembership(MembershipCheck.PENDING)
TrainingMembership.UNKNOWN = TrainingMembership(MembershipCheck.UNKNOWN)


def may_ask(device: str, isolation: IsolationStatus, asked_ns: int | None, now_ns: int) -> bool:
    """Whether a stage on ``device`` may ask now: on a GPU, while the isolation is ready, and no sooner than
    ``TRAINING_RECHECK_S`` after it last asked (``asked_ns``), whatever the processes sending."""
    if control.cuda_device_index(device) is None or isolation.state is not IsolationState.READY:
        return False
    return asked_ns is None or now_ns - asked_ns >= TRAINING_RECHECK_S * 1e9
