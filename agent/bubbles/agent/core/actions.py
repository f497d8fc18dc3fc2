"""What the core decides: the actions the shell (``bubbles.agent.server.Agent``) carries out, in order.

Like DeepSpeed's ``PipeInstruction`` values, each is a plain frozen record; the core never carries one out itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core.identity import GpuKey

from .records import JobRecord


@dataclass(frozen=True)
class Launch:
    """Start ``job``'s process on ``device`` (pinned to ``core``); ``isolated``: give it the isolation's
    client environment. Report back with ``AgentCore.launched`` or ``AgentCore.launch_failed``. A gang's member
    (``job.gang``): one of N launches of one decision, each with every GPU's fill socket of the gang (``sockets``, its
    own first); the shell gives the N processes one rendezvous port."""

    job: JobRecord
    device: str
    core: int | None
    socket_path: Path
    isolated: bool
    sockets: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Send:
    """Write one control command (``bubbles.core.control``) to ``job``'s process."""

    job: JobRecord
    type: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Signal:
    """Send ``sig`` to ``job``'s process."""

    job: JobRecord
    sig: int


@dataclass(frozen=True)
class Release:
    """``job``'s process has exited: close its descriptors and remove its fill socket."""

    job: JobRecord
    socket_path: Path


@dataclass(frozen=True)
class VerifyIsolation:
    """Check, off the loop (it may call the MPS control program), that ``job``'s process, which has initialized
    ``device``, is isolated as its mode promises: under MPS, a client of the node's server. Report back with
    ``AgentCore.isolation_verified``; the job is not armed until then."""

    job: JobRecord
    device: str


@dataclass(frozen=True)
class VerifyTraining:
    """Ask, off the loop, what the training's process ``pid`` on GPU ``key``'s ``device`` is to the isolation's
    shared server (``Isolation.training_membership``); report back with ``AgentCore.training_membership``. Said,
    never acted on."""

    key: GpuKey
    pid: int
    device: str


Action = Launch | Send | Signal | Release | VerifyIsolation | VerifyTraining
