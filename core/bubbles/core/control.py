"""The control channel between the agent and a fill process: newline-delimited JSON over a socketpair.

Low rate by design: the per-bubble signals go from the hook straight to the fill job's datagram
socket (``bubbles.core.wire``); this channel carries the agent's commands (init, arm, disarm, share,
limits, stop) and the fill job's reports (state, step_begin, step, profile, finished, error). Each line is
one JSON object with a ``type`` and that type's fields. ``parse_command``/``parse_event`` are the
only parsers; they reject anything else with ``ControlError`` saying what is wrong.

Versions (``VERSION``): the agent (a DaemonSet) and the SDK (in each fill job's image) are upgraded apart. From v2
on each side reads the other's lines the way protobuf reads messages: a field it does not know is left out of the
parsed message and named in ``ControlMessage.unknown`` (the receiver says so once), while a known field with a bad
value, an unknown type or a missing required field is still refused. New fields therefore reach an older peer
harmlessly; a new command or event type is refused by it with a message, and the line is dropped. (v1 refused
unknown fields too: its SDKs and agents work only with their own release.) v3 adds the version itself: the attaching
process says its version in ``hello`` (``protocol``) and the agent its own in ``welcome``; each refuses a peer older
than ``MIN_VERSION``, naming both versions. A peer that sends no version predates the field: v2. v4 adds gang jobs (a
fill job over several GPUs of one stage, one process each): ``arm`` carries ``sockets``, every GPU's fill socket of the
gang with the process's own GPU's first (``socket`` stays, the first, for runtimes before it); ``hello`` carries the
process's ``gang_rank`` and ``welcome`` the gang's ``sockets``. A runtime before v4 armed for a gang would listen on its
own GPU only, and so start steps whose collectives wait for peers still inside the training's compute: the steps would
outlive their bubbles until the watchdog killed them. The agent therefore refuses a gang process whose ``hello`` says
no ``gang_rank`` (only v4 SDKs send one), with a reason naming the upgrade. v5 adds fill sockets passed as file
descriptors (issue 36: fill Pods without hostPath and of any UID). A process that attaches through its Pod's own
attach socket (the CSI volume's ``_attach/attach.sock``) binds nothing: the agent binds its fill socket(s) in the
training's GPU directory (the path(s) of ``welcome``'s ``socket``/``sockets``, which the fill Pod does not mount) and
passes them with the ``welcome`` line itself (SCM_RIGHTS, in one sendmsg), saying how many in ``welcome``'s ``fds``: as
many as the sockets listed (``sockets``, else the one ``socket``), or 0 to a gang's follower, which listens on none. A
``welcome`` that carries ``fds`` (even 0) tells the process not to bind: an ``arm`` then names which of the passed
sockets to listen on (by their paths), and the agent makes each path appear in the training's ``fills/`` (a link to
the socket it bound) before it sends an ``arm`` in harvest mode, and removes it before it sends ``disarm`` or
``stop``, as the process bound and unlinked it itself before. Datagrams queued on a passed socket when an ``arm``
comes are from before it, and the process drops them. A process below v5 attaching through a Pod's own socket is
refused (``FD_VERSION``), naming the upgrade; over the node-wide attach socket (the hostPath layout) and over a
locally started process's socketpair nothing changed, and v2 to v4 peers work there as before.

The fill process inherits its end of the socketpair; its number is in ``$BUBBLES_CONTROL_FD``.

In a cluster the agent does not start fill processes: the operator creates each fill job's Pod, and its process
*attaches*. It connects to the agent's node-local attach socket (``bubbles.core.paths.attach_socket``), sends one
``hello`` line (its FillJob's uid and attempt, and the GPU it sees), and reads one reply: ``welcome`` (the job's
name and datagram socket on this node; the connection is then its control channel, as above) or ``refused``
(why). ``parse_hello``/``parse_reply`` are their parsers. Where the node runs the CSI driver, the attach socket is the
fill Pod's own (``<its volume>/_attach/attach.sock``, the same relative place) and the welcome passes the sockets
(v5, above).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bubbles.core.api import FillMode, check_tail_risk

# Environment the agent gives a fill process (the runtime in bubbles.sdk reads it).
CONTROL_FD_ENV = "BUBBLES_CONTROL_FD"  # inherited socketpair end
JOB_ENV = "BUBBLES_FILL_JOB"  # the fill job's name
SOCKET_ENV = "BUBBLES_FILL_SOCKET"  # fill-<job>.sock path to bind while armed in harvest mode
STEP_S_ENV = "BUBBLES_STEP_S"  # the step time from the spec, if known (seconds)
MEMORY_ENV = "BUBBLES_MEMORY_BYTES"  # memory limit for the accelerator's caching allocator
DEVICE_ENV = "BUBBLES_DEVICE"  # "cpu" or "cuda:N"
CORE_ENV = "BUBBLES_CPU_CORE"  # CPU core to pin to (absent: no pinning)
MAX_STEPS_ENV = "BUBBLES_MAX_STEPS"  # stop after this many steps (the spec's `steps`)
# Set by the operator in a fill Pod: the process attaches to the node's agent instead of inheriting a channel.
UID_ENV = "BUBBLES_FILL_JOB_UID"  # the FillJob's metadata.uid
SPIN_US_ENV = "BUBBLES_SPIN_US"  # busy-poll this long either side of a predicted bubble start (0 or absent: never)
TAIL_RISK_ENV = "BUBBLES_TAIL_RISK"  # accepted chance that a step started past a bubble's predicted end outlives it
FILL_WAIT_ENV = "BUBBLES_FILL_WAIT"  # how a fill process waits for its step's GPU work: block (sleep) or spin
ATTEMPT_ENV = "BUBBLES_FILL_ATTEMPT"  # its status.restarts when placed
ARGS_ENV = "BUBBLES_FILL_ARGS"  # the job's keyword arguments (a JSON object), when not given as --args
CHECKPOINT_ENV = "BUBBLES_CHECKPOINT"  # a directory where the SDK keeps the job's state across attempts
# A gang (a fill job over several GPUs of one stage, ``FillJobSpec.gpus``): each of its processes is told its place in
# it and where the gang's processes meet (a TCP port on 127.0.0.1 for torch.distributed or the like); absent for a
# single-GPU job. Each process is armed with every GPU's fill socket (``arm``'s ``sockets``), and gates on the bubbles
# they share.
GANG_RANK_ENV = "BUBBLES_GANG_RANK"  # 0 .. size-1
GANG_SIZE_ENV = "BUBBLES_GANG_SIZE"  # the job's gpus
GANG_PORT_ENV = "BUBBLES_GANG_PORT"  # where the gang's processes rendezvous
MAX_GANG = 16  # processes (GPUs) of one gang the channel carries: more than a node's GPUs of a stage

# A fill process's /proc/PID/oom_score_adj, the highest: when the node runs out of memory the kernel's OOM killer takes
# fill processes before the training. The agent sets it on the processes it starts, the SDK on its own process (a fill
# Pod's too); raising one's own score needs no privilege, and children inherit it.
FILL_OOM_SCORE_ADJ = 1000
MAX_LINE_BYTES = 64 * 1024
VERSION = 5
MIN_VERSION = 2  # the oldest peer either side works with: from v2 on unknown fields are tolerated
FD_VERSION = 5  # the oldest SDK that takes its fill sockets as passed descriptors (a Pod's own attach socket)
UNVERSIONED = 2  # what a peer that sends no version speaks

# The fill modes a fill process is armed in, as the channel writes them (FillMode labels; OFF is disarm).
ARMED_MODES = (FillMode.HARVEST, FillMode.NAIVE)
MODES = tuple(m.label for m in ARMED_MODES)
STATES = ("CREATED", "PAUSED", "RUNNING", "STOPPED")

_NUM = (int, float)
# type -> {field: (python types, required)}
COMMANDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "init": {},
    # sockets (v4): a gang's fill sockets, one per GPU, the process's own GPU's first; socket, when both come, is the
    # first of them (what a runtime before v4 binds).
    "arm": {"mode": ((str,), True), "share": (_NUM, False), "socket": ((str,), False), "sockets": ((list,), False)},
    "disarm": {},
    "share": {"share": (_NUM, True)},
    # The training's limit on steps past a bubble's predicted end: the runtime takes the lower of this and its own
    # $BUBBLES_TAIL_RISK. Its own command, not a field of arm: a runtime older than it answers an error line and
    # goes on, where an arm with a field it does not know would be refused whole.
    "limits": {"tail_risk": (_NUM, False)},
    "stop": {},
}
EVENTS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "state": {"state": ((str,), True)},
    "step_begin": {"t_ns": ((int,), True), "bubble_seq": ((int,), True)},
    "step": {
        "start_ns": ((int,), True),
        "end_ns": ((int,), True),
        "flops": (_NUM, True),
        "samples": ((int,), False),
        "bubble_seq": ((int,), False),
        "signal_ns": ((int,), False),
        "mode": ((str,), False),  # the mode the step ran in: reports of naive steps can arrive late
        # Of the step's time, how long the runtime waited for its queued device work (CUDA synchronize);
        # informational: the step's end already includes it. Absent from runtimes before issue 3.
        "sync_ns": ((int,), False),
        "size": ((int,), False),  # the step's size, for a job with step_sizes
        # "tail": the step started past its bubble's predicted end, on the runtime's estimate of the risk that it
        # outlives the bubble (bubbles.training.gating.TailRisk); absent: it started where the prediction allowed it.
        "gate": ((str,), False),
    },
    # step_s: the time the agent plans with (a job with step sizes: its smallest); sizes: [[size, step_s], ...]
    # of such a job, smallest first
    "profile": {"step_s": (_NUM, True), "sizes": ((list,), False)},
    "finished": {},
    "error": {"message": ((str,), True)},
}


# Fields that count something and so cannot be negative (a negative count would be subtracted from the totals).
NON_NEGATIVE = frozenset({"step.flops"})


# The attach handshake: the process's first line, and the agent's one reply.
HELLO: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "hello": {"uid": ((str,), True), "attempt": ((int,), True), "gpu": ((str,), False), "pid": ((int,), False),
              "protocol": ((int,), False), "gang_rank": ((int,), False)},
}
REPLIES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "welcome": {"job": ((str,), True), "socket": ((str,), True), "stage": ((int,), True),
                "protocol": ((int,), False), "sockets": ((list,), False),
                # fds (v5): the fill sockets passed with this line (SCM_RIGHTS), in the order of sockets (else the
                # one socket); present, even 0: the process binds none
                "fds": ((int,), False)},
    "refused": {"reason": ((str,), True)},
}


class ControlError(ValueError):
    """A control line that is not a valid command or event; the receiver drops it and goes on."""


@dataclass(frozen=True)
class ControlMessage:
    """One parsed command or event: its type and its validated fields."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()  # fields left out: a newer peer's (see the module's documentation)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def encode(type_: str, **fields: Any) -> bytes:
    """One line: ``{"type": ..., **fields}\\n`` (compact JSON, no NaN)."""
    return json.dumps({"type": type_, **fields}, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def parse_command(line: bytes | str) -> ControlMessage:
    """Parse one agent->job line; raise ControlError naming what is wrong."""
    msg = _parse(line, COMMANDS, "command")
    if msg.type == "arm":
        parse_mode(msg["mode"], "arm.mode")
        if "sockets" in msg.fields:
            check_sockets(msg["sockets"], "arm.sockets", msg.get("socket"))
    if "share" in msg.fields and not 0 <= msg["share"] <= 1:
        raise ControlError(f"{msg.type}.share must be in [0, 1], got {msg['share']!r}")
    if "tail_risk" in msg.fields:
        try:
            check_tail_risk(msg["tail_risk"], f"{msg.type}.tail_risk")
        except ValueError as exc:
            raise ControlError(str(exc)) from None
    return msg


def parse_event(line: bytes | str) -> ControlMessage:
    """Parse one job->agent line; raise ControlError naming what is wrong."""
    msg = _parse(line, EVENTS, "event")
    if msg.type == "step" and msg.get("gate", "tail") != "tail":
        raise ControlError(f"step.gate must be 'tail' (or absent), got {msg['gate']!r}")
    if msg.type == "state" and msg["state"] not in STATES:
        raise ControlError(f"state.state must be one of {', '.join(STATES)}, got {msg['state']!r}")
    if msg.type == "step" and msg["end_ns"] < msg["start_ns"]:
        raise ControlError("step ends before it starts")
    if msg.type == "step" and not 0 <= msg.get("sync_ns", 0) <= msg["end_ns"] - msg["start_ns"]:
        raise ControlError(f"step.sync_ns must be between 0 and the step's duration "
                           f"({msg['end_ns'] - msg['start_ns']} ns), got {msg['sync_ns']!r}")
    if msg.type == "step" and "mode" in msg.fields:
        parse_mode(msg["mode"], "step.mode")
    if msg.type == "step" and msg.get("size", 1) < 1:
        raise ControlError(f"step.size must be >= 1, got {msg['size']!r}")
    if msg.type == "profile" and not msg["step_s"] > 0:
        raise ControlError(f"profile.step_s must be > 0, got {msg['step_s']!r}")
    if msg.type == "profile" and "sizes" in msg.fields:
        _check_sizes(msg["sizes"])
    return msg


def _check_sizes(sizes: list[Any]) -> None:
    """profile.sizes: [[size, step_s], ...], sizes >= 1 and increasing, times > 0 and finite."""
    last = 0
    for pair in sizes:
        ok = isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and \
            not isinstance(pair[0], bool) and isinstance(pair[1], int | float) and not isinstance(pair[1], bool)
        if not ok or pair[0] <= last or not 0 < pair[1] < math.inf:
            raise ControlError(f"profile.sizes must be [[size, step_s], ...] with sizes increasing from 1 and "
                               f"step times > 0, got {sizes!r}")
        last = pair[0]


def parse_hello(line: bytes | str) -> ControlMessage:
    """Parse an attaching process's first line; ControlError naming what is wrong."""
    msg = _parse(line, HELLO, "hello")
    if not msg["uid"] or msg["attempt"] < 0:
        raise ControlError("hello needs the FillJob's uid and an attempt >= 0 (the operator sets "
                           f"${UID_ENV} and ${ATTEMPT_ENV} in the fill Pod)")
    if not 0 <= msg.get("gang_rank", 0) < MAX_GANG:
        raise ControlError(f"hello.gang_rank must be the process's place in its gang, from 0 to {MAX_GANG - 1} "
                           f"(${GANG_RANK_ENV}), got {msg['gang_rank']!r}")
    _check_version(msg)
    return msg


def parse_reply(line: bytes | str) -> ControlMessage:
    """Parse the agent's answer to ``hello``; ControlError naming what is wrong."""
    msg = _parse(line, REPLIES, "reply")
    _check_version(msg)
    if "sockets" in msg.fields:
        check_sockets(msg["sockets"], "welcome.sockets", msg["socket"])
    if "fds" in msg.fields:
        listed = len(msg.get("sockets") or [msg["socket"]])
        if msg["fds"] not in (0, listed):
            raise ControlError(f"welcome.fds must be 0 or the number of sockets the welcome lists ({listed}), got "
                               f"{msg['fds']!r}")
    return msg


def passed_sockets(msg: ControlMessage) -> list[str] | None:
    """The paths of the fill sockets a v5 ``welcome`` passed as descriptors, in the order they came (``fds`` of the
    sockets listed; [] to a gang's follower); None where the welcome passed none and the process binds its own."""
    if msg.type != "welcome" or "fds" not in msg.fields:
        return None
    return list(msg.get("sockets") or [msg["socket"]])[: msg["fds"]]


def check_sockets(sockets: list[Any], what: str, first: str | None = None) -> list[str]:
    """A gang's fill sockets (``arm.sockets``, ``welcome.sockets``): 1 to ``MAX_GANG`` distinct absolute paths, the
    process's own GPU's first, so equal to ``first`` (the message's ``socket``) when that is given; ControlError
    naming ``what`` otherwise."""
    ok = 1 <= len(sockets) <= MAX_GANG and all(isinstance(p, str) and p.startswith("/") and "\0" not in p
                                               for p in sockets)
    if not ok or len(set(sockets)) != len(sockets):
        raise ControlError(f"{what} must list 1 to {MAX_GANG} distinct absolute socket paths (one per GPU of the "
                           f"gang, its own GPU's first), got {sockets!r}"[:400])
    if first is not None and sockets[0] != first:
        raise ControlError(f"{what} must start with the process's own GPU's socket {first!r}, got {sockets[0]!r}")
    return sockets


def peer_version(msg: ControlMessage) -> int:
    """The control protocol version a ``hello`` or ``welcome`` says its sender speaks (``UNVERSIONED`` if none)."""
    return int(msg.get("protocol", UNVERSIONED))


def _check_version(msg: ControlMessage) -> None:
    if "protocol" in msg.fields and msg["protocol"] < 1:
        raise ControlError(f"{msg.type}.protocol must be a version >= 1, got {msg['protocol']!r}")


def parse_mode(text: object, what: str = "mode") -> FillMode:
    """The FillMode a control line's ``mode`` field names (exactly ``harvest`` or ``naive``: the wire's
    spelling); ControlError naming ``what`` and the choices otherwise."""
    for m in ARMED_MODES:
        if text == m.label:
            return m
    raise ControlError(f"{what} must be one of {', '.join(MODES)}, got {text!r}")


def _parse(line: bytes | str, schema: dict[str, dict[str, tuple[tuple[type, ...], bool]]],
           what: str) -> ControlMessage:
    if isinstance(line, bytes | bytearray):
        if len(line) > MAX_LINE_BYTES:
            raise ControlError(f"{what} line of {len(line)} bytes exceeds the {MAX_LINE_BYTES}-byte limit")
        try:
            line = bytes(line).decode()
        except UnicodeDecodeError as exc:
            raise ControlError(f"{what} line is not UTF-8: {exc}") from None
    if not isinstance(line, str):
        raise ControlError(f"{what} line must be bytes or str, got {type(line).__name__}")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ControlError(f"{what} line is not JSON ({exc}): {line[:80]!r}") from None
    except RecursionError:  # nested deeper than the parser's stack: no message is, and it must not stop the agent
        raise ControlError(f"{what} line is nested too deeply: {line[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ControlError(f"{what} line must be a JSON object, got {type(obj).__name__}")
    type_ = obj.pop("type", None)
    if type_ not in schema:
        raise ControlError(f"unknown {what} type {type_!r}; expected one of {', '.join(schema)}")
    spec = schema[type_]
    unknown = tuple(sorted(name for name in obj if name not in spec))
    for name in unknown:
        del obj[name]
    for name, (types, required) in spec.items():
        if name not in obj:
            if required:
                raise ControlError(f"{what} {type_!r} is missing field {name!r}")
            continue
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, types):
            names = " or ".join(t.__name__ for t in types)
            raise ControlError(f"{what} {type_}.{name} must be {names}, got {v!r}")
        if float in types and not _finite(v):  # a float field given a huge int: it would not fit in a float
            raise ControlError(f"{what} {type_}.{name} must be finite, got {v!r}")
        if f"{type_}.{name}" in NON_NEGATIVE and isinstance(v, int | float) and v < 0:
            raise ControlError(f"{what} {type_}.{name} must be >= 0, got {v!r}")
    return ControlMessage(type_, obj, unknown)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


class LineBuffer:
    """Splits a byte stream into lines; a line longer than MAX_LINE_BYTES is cut off and reported."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Yield the complete lines in ``data`` (plus what was buffered); an overlong line yields b""."""
        self._buf += data
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                if len(self._buf) > MAX_LINE_BYTES:
                    self._buf.clear()
                    if not self._discarding:
                        self._discarding = True
                        yield b"\x00overlong"  # not JSON: the parser rejects and counts it
                return
            line = bytes(self._buf[:i])
            del self._buf[: i + 1]
            if self._discarding:
                self._discarding = False
                continue
            if line.strip():
                yield line


def cuda_device_index(device: str) -> int | None:
    """The CUDA device index of an agent device string: None for ``"cpu"``/``"cpu:K"``, N for ``"cuda:N"``
    (``"cuda"`` alone is device 0: a fresh fill process's current device). ValueError for anything else."""
    kind, sep, number = device.strip().partition(":")
    if kind == "cpu" and (not sep or number.isdigit()):
        return None
    if kind == "cuda" and (not sep or number.isdigit()):
        return int(number) if sep else 0
    raise ValueError(f"device {device!r} is neither 'cpu', 'cpu:K' nor 'cuda:N'; "
                     f"check ${DEVICE_ENV} or the agent's --devices")
