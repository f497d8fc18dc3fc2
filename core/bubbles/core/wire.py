"""The bubble signal protocol: datagrams from the training's hook to the agent and fill jobs.

Signals are small fixed-size binary records so that the hook's cost on the training's critical path
is one ``struct.pack`` and one non-blocking ``sendto`` per listener. The bubble profile, sent rarely,
is JSON. Every record carries the stage, a sequence number and absolute CLOCK_MONOTONIC timestamps
(shared by all processes on a node), never bare pulses: a lost or reordered datagram is detectable
and cannot leave a listener believing a bubble is still open.

``decode`` is the only way bytes become messages; it rejects garbage, truncated, oversized and
malformed input with ``WireError`` and never raises anything else.

Versions. The hook runs inside training images and the agent in a DaemonSet, and the two are upgraded apart, so
the protocol only grows: a later version may add message kinds and append fields to a kind's record, never change
or remove what is there. A receiver therefore reads any version from 1 up: from a newer sender it takes the fields
it knows (a record's first bytes) and ignores the rest, and it drops a kind it does not know with ``NewerMessage``
(a ``WireError`` its receivers say once rather than count as garbage). Version-1 records must have their exact
size. A change that an older receiver would misread needs a new magic, which older receivers refuse outright.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from bubbles.core.api import FillMode

MAGIC = b"BB"
VERSION = 1
MAX_DATAGRAM_BYTES = 64 * 1024

_HEADER = struct.Struct("<2sBBH")  # magic, version, kind, stage
# BUBBLE_START / BUBBLE_END: header + slot, seq, t_ns, predicted_end_ns
_BUBBLE = struct.Struct("<2sBBHHIqq")
# ITERATION: header + reserved, iteration index, start_ns, duration_ns
_ITERATION = struct.Struct("<2sBBHHIqq")
# FILL_MODE: header + mode code
_MODE = struct.Struct("<2sBBHB")
SIGNAL_BYTES = _BUBBLE.size  # every BUBBLE_START, BUBBLE_END and ITERATION datagram (28 bytes)


class Kind(enum.IntEnum):
    PROFILE = 1
    BUBBLE_START = 2
    BUBBLE_END = 3
    ITERATION = 4
    FILL_MODE = 5


class WireError(ValueError):
    """A datagram that is not a valid bubble message; the receiver drops it and keeps serving."""


class NewerMessage(WireError):
    """A message kind (or a value of a known field, ``what``) this side does not know, from a sender speaking a newer
    version: not garbage, just not for this receiver. ``version`` and ``kind`` say what it was."""

    def __init__(self, version: int, kind: int, what: str = "") -> None:
        said = what or f"message kind {kind}"
        super().__init__(f"{said} from protocol version {version} (this side speaks {VERSION}): ignored; upgrade "
                         "this side to use it")
        self.version = version
        self.kind = kind


@dataclass(frozen=True)
class BubbleStart:
    stage: int
    slot: int
    seq: int
    start_ns: int
    predicted_end_ns: int
    kind: Kind = Kind.BUBBLE_START


@dataclass(frozen=True)
class BubbleEnd:
    stage: int
    slot: int
    seq: int
    end_ns: int
    kind: Kind = Kind.BUBBLE_END


@dataclass(frozen=True)
class Iteration:
    stage: int
    iteration: int
    start_ns: int
    duration_ns: int
    kind: Kind = Kind.ITERATION


@dataclass(frozen=True)
class Profile:
    stage: int
    cycle: dict[str, Any]  # BubbleCycle.to_dict(); validated by BubbleCycle.from_dict at the receiver
    kind: Kind = Kind.PROFILE


@dataclass(frozen=True)
class FillModeChange:
    stage: int
    mode: FillMode
    kind: Kind = Kind.FILL_MODE


Message = BubbleStart | BubbleEnd | Iteration | Profile | FillModeChange


def encode_bubble_start(stage: int, slot: int, seq: int, start_ns: int, predicted_end_ns: int) -> bytes:
    return _BUBBLE.pack(MAGIC, VERSION, Kind.BUBBLE_START, stage, slot, seq & 0xFFFFFFFF, start_ns,
                        predicted_end_ns)


def encode_bubble_end(stage: int, slot: int, seq: int, end_ns: int) -> bytes:
    return _BUBBLE.pack(MAGIC, VERSION, Kind.BUBBLE_END, stage, slot, seq & 0xFFFFFFFF, end_ns, 0)


def encode_iteration(stage: int, iteration: int, start_ns: int, duration_ns: int) -> bytes:
    return _ITERATION.pack(MAGIC, VERSION, Kind.ITERATION, stage, 0, iteration & 0xFFFFFFFF, start_ns,
                           duration_ns)


def encode_fill_mode(stage: int, mode: FillMode) -> bytes:
    return _MODE.pack(MAGIC, VERSION, Kind.FILL_MODE, stage, int(mode))


def encode_profile(stage: int, cycle: dict[str, Any]) -> bytes:
    body = json.dumps(cycle, separators=(",", ":"), allow_nan=False).encode()
    data = _HEADER.pack(MAGIC, VERSION, Kind.PROFILE, stage) + body
    if len(data) > MAX_DATAGRAM_BYTES:
        raise WireError(f"profile of {len(data)} bytes exceeds the {MAX_DATAGRAM_BYTES}-byte datagram limit")
    return data


_START_END = (int(Kind.BUBBLE_START), int(Kind.BUBBLE_END))


def decode_signal(data: bytes) -> tuple[int, int, int, int, int] | None:
    """The fill runtime's fast path for the two messages it waits on: ``(kind, slot, seq, t_ns, predicted_end_ns)``
    of a valid BUBBLE_START or BUBBLE_END, as plain integers (no message object on the wake-up path); None for
    anything else, which ``decode`` then handles (and rejects, if invalid), so both agree on every input."""
    size = len(data)
    if size < SIGNAL_BYTES:
        return None
    magic, version, kind, _stage, slot, seq, t1, t2 = _BUBBLE.unpack_from(data)
    # Version 1 at its exact size; a newer version at that size or longer (fields appended), as ``decode`` reads them.
    if magic != MAGIC or not (version > VERSION or (version == VERSION and size == SIGNAL_BYTES)) \
            or kind not in _START_END or t1 < 0 or t2 < 0:
        return None
    if kind == Kind.BUBBLE_START and t2 < t1:
        return None
    return kind, slot, seq, t1, t2


def decode(data: bytes) -> Message:
    """Parse one datagram; raise ``WireError`` saying what is wrong with it."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_DATAGRAM_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_DATAGRAM_BYTES}-byte limit")
    if len(data) < _HEADER.size:
        raise WireError(f"truncated message: {len(data)} bytes, a header needs {_HEADER.size}")
    magic, version, kind_code, stage = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a bubbles message")
    if version < 1:
        raise WireError(f"protocol version {version} does not exist (versions start at 1)")
    newer = version > VERSION
    try:
        kind = Kind(kind_code)
    except ValueError:
        if newer:
            raise NewerMessage(version, kind_code) from None
        raise WireError(f"unknown message kind {kind_code}") from None

    def record(layout: struct.Struct) -> tuple[Any, ...]:
        # A newer sender may append fields: read the ones this side knows. Version 1's records are exact.
        too_short = len(data) < layout.size
        if too_short or (len(data) != layout.size and not newer):
            raise WireError(f"{kind.name} must be {'at least ' if newer else ''}{layout.size} bytes, "
                            f"got {len(data)}")
        return layout.unpack_from(data)

    if kind in (Kind.BUBBLE_START, Kind.BUBBLE_END, Kind.ITERATION):
        _, _, _, stage, a, b, t1, t2 = record(_BUBBLE)
        if t1 < 0 or t2 < 0:
            raise WireError(f"{kind.name} has a negative timestamp")
        if kind is Kind.BUBBLE_START:
            if t2 < t1:
                raise WireError("BUBBLE_START predicts an end before its start")
            return BubbleStart(stage=stage, slot=a, seq=b, start_ns=t1, predicted_end_ns=t2)
        if kind is Kind.BUBBLE_END:
            return BubbleEnd(stage=stage, slot=a, seq=b, end_ns=t1)
        return Iteration(stage=stage, iteration=b, start_ns=t1, duration_ns=t2)
    if kind is Kind.FILL_MODE:
        mode_code = record(_MODE)[4]
        try:
            return FillModeChange(stage=stage, mode=FillMode(mode_code))
        except ValueError:
            if newer:  # a mode added after this version
                raise NewerMessage(version, kind_code, f"fill mode {mode_code}") from None
            raise WireError(f"unknown fill mode {mode_code}") from None
    # PROFILE
    try:
        body = json.loads(data[_HEADER.size:].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"PROFILE body is not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser's stack: no profile is, and it must not stop the agent
        raise WireError("PROFILE body is nested too deeply") from None
    if not isinstance(body, dict):
        raise WireError("PROFILE body must be a JSON object")
    return Profile(stage=stage, cycle=body)
