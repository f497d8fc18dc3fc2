"""The signal protocol and the bubble-cycle record: what the agent accepts from a socket, and what it refuses."""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubbles.core import wire
from bubbles.core.cycle import BubbleCycle, BubbleSlot, robust_stats


def cycle_dict(**overrides: Any) -> dict[str, Any]:
    slot = BubbleSlot(0, 3, "RecvGrad", "fwd-bwd", 0.004, 0.003, 0.005, 1 << 30)
    d = BubbleCycle("t", 0, 2, 8, "TrainSchedule", 0.05, (slot,), 5, wait_s=0.006).to_dict()
    d.update(overrides)
    return d


def test_every_message_round_trips() -> None:
    assert wire.decode(wire.encode_bubble_start(1, 2, 3, 10, 20)) == wire.BubbleStart(1, 2, 3, 10, 20)
    assert wire.decode(wire.encode_bubble_end(1, 2, 3, 30)) == wire.BubbleEnd(1, 2, 3, 30)
    assert wire.decode(wire.encode_iteration(0, 7, 10, 50)) == wire.Iteration(0, 7, 10, 50)
    assert wire.decode(wire.encode_fill_mode(1, wire.FillMode.NAIVE)) == wire.FillModeChange(1, wire.FillMode.NAIVE)
    msg = wire.decode(wire.encode_profile(0, cycle_dict()))
    assert isinstance(msg, wire.Profile) and BubbleCycle.from_dict(msg.cycle).wait_s == 0.006


@pytest.mark.parametrize("data,reason", [
    (b"", "truncated"),
    (b"BB\x01", "truncated"),
    (b"XX\x01\x02\x00\x00" + bytes(20), "bad magic"),
    (b"BB\x00\x02\x00\x00" + bytes(22), "version 0 does not exist"),
    (b"BB\x09\x02\x00\x00" + bytes(20), "BUBBLE_START must be at least 28 bytes"),  # newer, but truncated
    (struct.pack("<2sBBH", b"BB", 9, 5, 0), "FILL_MODE must be at least 7 bytes"),
    (b"BB\x01\x63\x00\x00" + bytes(20), "unknown message kind 99"),
    (wire.encode_bubble_start(0, 0, 1, 10, 20)[:-1], f"must be {wire.SIGNAL_BYTES} bytes"),
    (wire.encode_bubble_start(0, 0, 1, 10, 20) + b"x", f"must be {wire.SIGNAL_BYTES} bytes"),
    (struct.pack("<2sBBHHIqq", b"BB", 1, 2, 0, 0, 1, 20, 10), "end before its start"),
    (struct.pack("<2sBBHHIqq", b"BB", 1, 3, 0, 0, 1, -5, 0), "negative timestamp"),
    (struct.pack("<2sBBHB", b"BB", 1, 5, 0, 7), "unknown fill mode 7"),
    (b"BB\x01\x01\x00\x00{not json", "not valid JSON"),
    (b"BB\x01\x01\x00\x00[1, 2]", "must be a JSON object"),
    # Within the size limit, deeper than the JSON parser's stack: a RecursionError would have stopped the agent.
    (b"BB\x01\x01\x00\x00" + b"[" * 60_000, "nested too deeply"),
    (b"BB\x01\x01\x00\x00" + b" " * wire.MAX_DATAGRAM_BYTES, "exceeds"),
])
def test_malformed_datagrams_are_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(data)


def newer(data: bytes, tail: bytes = b"\x01\x02\x03\x04") -> bytes:
    """``data`` as a sender speaking protocol version 2 would send it, with fields appended."""
    return data[:2] + bytes([wire.VERSION + 1]) + data[3:] + tail


def test_a_newer_senders_records_read_as_the_fields_this_side_knows() -> None:
    assert wire.decode(newer(wire.encode_bubble_start(1, 2, 3, 10, 20))) == wire.BubbleStart(1, 2, 3, 10, 20)
    assert wire.decode(newer(wire.encode_bubble_end(1, 2, 3, 30))) == wire.BubbleEnd(1, 2, 3, 30)
    assert wire.decode(newer(wire.encode_iteration(0, 7, 10, 50))) == wire.Iteration(0, 7, 10, 50)
    assert wire.decode(newer(wire.encode_fill_mode(1, wire.FillMode.OFF))) == wire.FillModeChange(1, wire.FillMode.OFF)
    profile = wire.encode_profile(0, cycle_dict(future_field={"x": 1}))
    msg = wire.decode(newer(profile, tail=b""))
    assert isinstance(msg, wire.Profile) and BubbleCycle.from_dict(msg.cycle).wait_s == 0.006
    # The fast path agrees: a newer START or END wakes the fill runtime as a version-1 one does.
    start = newer(wire.encode_bubble_start(1, 2, 3, 10, 20))
    assert wire.decode_signal(start) == (wire.Kind.BUBBLE_START, 2, 3, 10, 20)
    assert wire.decode_signal(newer(wire.encode_bubble_end(1, 2, 3, 30))) == (wire.Kind.BUBBLE_END, 2, 3, 30, 0)
    # ...and it still refuses what decode refuses: a newer record's known fields are checked as before.
    bad = newer(struct.pack("<2sBBHHIqq", b"BB", 1, 2, 0, 0, 1, 20, 10))
    assert wire.decode_signal(bad) is None
    with pytest.raises(wire.WireError, match="end before its start"):
        wire.decode(bad)


def test_a_kind_from_a_newer_sender_is_told_apart_from_garbage() -> None:
    with pytest.raises(wire.NewerMessage, match="kind 42 from protocol version 2") as caught:
        wire.decode(struct.pack("<2sBBH", b"BB", 2, 42, 0) + bytes(30))
    assert isinstance(caught.value, wire.WireError) and (caught.value.version, caught.value.kind) == (2, 42)
    with pytest.raises(wire.WireError, match="unknown message kind 42") as refused:  # from this version: garbage
        wire.decode(struct.pack("<2sBBH", b"BB", wire.VERSION, 42, 0) + bytes(30))
    assert not isinstance(refused.value, wire.NewerMessage)
    # Appended bytes are a newer sender's right only: a version-1 record must have its exact size.
    assert wire.decode_signal(wire.encode_bubble_start(1, 2, 3, 10, 20) + b"x") is None
    # A fill mode added after this version is a newer sender's too, not garbage.
    with pytest.raises(wire.NewerMessage, match="fill mode 9 from protocol version 2"):
        wire.decode(struct.pack("<2sBBHB", b"BB", 2, 5, 0, 9))


@given(st.integers(0, 4), st.sampled_from([2, 3, 4, 5, 42]), st.binary(min_size=22, max_size=22),
       st.binary(max_size=6))
def test_the_fast_path_and_decode_agree_on_every_version(version: int, kind: int, body: bytes, tail: bytes) -> None:
    """What wakes a fill job (``decode_signal``) is exactly what ``decode`` reads as a START or END, for every
    version and size: a newer hook's bubbles wake fill jobs as the agent sees them, garbage wakes none."""
    data = struct.pack("<2sBBH", b"BB", version, kind, 0) + body[:22] + tail
    fast = wire.decode_signal(data)
    try:
        msg: wire.Message | None = wire.decode(data)
    except wire.WireError:
        msg = None
    if isinstance(msg, wire.BubbleStart):
        assert fast == (wire.Kind.BUBBLE_START, msg.slot, msg.seq, msg.start_ns, msg.predicted_end_ns)
    elif isinstance(msg, wire.BubbleEnd):
        assert fast is not None and fast[:4] == (wire.Kind.BUBBLE_END, msg.slot, msg.seq, msg.end_ns)
    else:
        assert fast is None


@given(st.binary(max_size=200))
def test_decode_never_raises_anything_but_wire_error(data: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(data)


def test_an_oversized_profile_is_refused_at_the_sender() -> None:
    with pytest.raises(wire.WireError, match="datagram limit"):
        wire.encode_profile(0, cycle_dict(training="x" * wire.MAX_DATAGRAM_BYTES))


@pytest.mark.parametrize("overrides,field", [
    ({"training": 3}, "'training' must be str"),
    ({"stage": -1}, "'stage' must be >= 0"),
    ({"stage": 2}, "outside a pipeline of 2 stages"),
    ({"stages": True}, "'stages' must be int"),
    ({"iteration_s": float("nan")}, "'iteration_s' must be a finite number"),
    ({"wait_s": -1.0}, "'wait_s' must be a finite number >= 0"),
    ({"wait_s": "long"}, "'wait_s' must be a finite number"),
    ({"slots": {}}, "'slots' must be list"),
    ({"slots": [1]}, r"slots\[0\] must be an object"),
    ({"slots": [{**cycle_dict()["slots"][0], "kind": "lunch"}]}, r"slots\[0\].kind 'lunch'"),
    ({"slots": [{**cycle_dict()["slots"][0], "free_bytes": -1}]}, "'free_bytes' must be >= 0"),
    ({"slots": [{**cycle_dict()["slots"][0], "allocated_bytes": -1}]}, "'allocated_bytes' must be >= 0"),
    ({"slots": [{**cycle_dict()["slots"][0], "allocated_bytes": "1Gi"}]}, "'allocated_bytes' must be int, got str"),
    ({"slots": [{**cycle_dict()["slots"][0], "allocated_bytes": 1.5}]}, "'allocated_bytes' must be int, got float"),
    ({"slots": [{**cycle_dict()["slots"][0], "allocated_bytes": True}]}, "'allocated_bytes' must be int, got bool"),
    ({"slots": [{**cycle_dict()["slots"][0], "allocated_bytes": None}]}, "'allocated_bytes' must be int"),
])
def test_a_bad_cycle_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BubbleCycle.from_dict(cycle_dict(**overrides))


def test_missing_fields_and_non_objects_are_refused() -> None:
    d = cycle_dict()
    del d["slots"]
    with pytest.raises(ValueError, match="missing field 'slots'"):
        BubbleCycle.from_dict(d)
    with pytest.raises(ValueError, match="must be an object"):
        BubbleCycle.from_dict(json.loads("[]"))


def test_a_cycle_without_wait_s_still_reads_and_counts_its_bubbles_as_idle() -> None:
    d = cycle_dict()
    del d["wait_s"]
    cycle = BubbleCycle.from_dict(d)
    assert cycle.wait_s == 0.0 and cycle.idle_ratio == pytest.approx(cycle.bubble_ratio)


def test_a_slots_allocated_memory_round_trips_and_old_profiles_without_it_read_as_zero() -> None:
    d = cycle_dict()
    d["slots"][0]["allocated_bytes"] = 20 << 30
    wired = wire.decode(wire.encode_profile(0, d))
    assert isinstance(wired, wire.Profile)
    cycle = BubbleCycle.from_dict(wired.cycle)
    assert cycle.slots[0].allocated_bytes == 20 << 30 and cycle.to_dict() == d
    del d["slots"][0]["allocated_bytes"]
    assert BubbleCycle.from_dict(d).slots[0].allocated_bytes == 0


def test_robust_stats_ignore_one_slow_sample() -> None:
    med, p10, p90 = robust_stats([1.0, 1.0, 1.0, 1.0, 100.0])
    assert med == 1.0 and p10 == 1.0 and p90 > 1.0
    with pytest.raises(ValueError):
        robust_stats([])


def test_recent_lengths_predict_the_smaller_of_p10_and_median_of_the_last_window() -> None:
    from bubbles.core.cycle import RecentLengths, predicted_length

    r = RecentLengths({7: [100, 100, 100]}, window=4)
    assert r.predicted_ns(7) == 100
    for v in (500, 500, 500, 500):
        r.add(7, v)
    assert r.predicted_ns(7) == 500  # the seeds left the window
    r.add(7, 50)
    assert r.predicted_ns(7) == int(predicted_length([500, 500, 500, 50]))
    assert predicted_length([50, 500, 500, 500]) < 500  # p10 below the median: the lower tail decides
    r.add(99, 1)  # a position it was not seeded with is ignored
    with pytest.raises(KeyError):
        r.predicted_ns(99)
    with pytest.raises(ValueError, match="seed"):
        RecentLengths({1: []})
    with pytest.raises(ValueError, match="window"):
        RecentLengths({1: [1]}, window=0)


def test_a_bubble_far_past_its_prediction_gets_a_longer_one_within_a_few_lengths() -> None:
    from bubbles.core.cycle import SHIFT_RUN, RecentLengths

    # Profiled at ~2.5 ms, then the bubble lasts 300-1300 ms (seen on a real training): with the low percentile of
    # 32 lengths alone the prediction would stay at 2.5 ms for ~29 iterations.
    r = RecentLengths({3: [2_300_000, 2_500_000, 2_900_000, 2_400_000, 2_600_000]}, window=32)
    assert r.predicted_ns(3) == 2_300_000 + int(0.4 * 100_000)  # p10 of the five
    long = [330_000_000, 1_340_000_000, 600_000_000, 900_000_000]
    assert [r.add(3, v) for v in long[:SHIFT_RUN]] == [False] * (SHIFT_RUN - 1) + [True]
    assert r.shifts == 1
    assert r.predicted_ns(3) >= 330_000_000  # the smallest of the run, at most
    # one long bubble between short ones is noise, not a shift
    q = RecentLengths({1: [1000] * 8}, window=32)
    for v in (5000, 1000, 5000, 5000, 1000):
        assert not q.add(1, v)
    assert q.predicted_ns(1) == 1000 and q.shifts == 0
    # a run just under the factor is not a shift either; shorter bubbles pull the prediction down on their own
    for v in (1999, 1999, 1999):
        assert not q.add(1, v)
    for v in [500] * 4:
        q.add(1, v)
    assert q.predicted_ns(1) == 500
    with pytest.raises(ValueError, match="shift_run"):
        RecentLengths({1: [1]}, window=4, shift_run=5)
    with pytest.raises(ValueError, match="shift_factor"):
        RecentLengths({1: [1]}, shift_factor=1.0)


def test_a_profiles_memory_margin_is_optional_and_never_negative() -> None:
    from bubbles.core.cycle import BubbleCycle

    d = {"training": "t", "stage": 0, "stages": 2, "microbatches": 4, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "slots": [], "samples": 3}
    assert BubbleCycle.from_dict(d).memory_margin_bytes == 0  # a profile from before the field existed
    assert BubbleCycle.from_dict({**d, "memory_margin_bytes": 1 << 29}).memory_margin_bytes == 1 << 29
    for bad in (-1, "512Mi", 1.5, True):
        with pytest.raises(ValueError, match="memory_margin_bytes"):
            BubbleCycle.from_dict({**d, "memory_margin_bytes": bad})
