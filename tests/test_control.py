"""The control protocol between the agent and fill processes: round trips and rejections."""

from __future__ import annotations

import pytest

from bubbles.core import control
from bubbles.core.api import FillMode


def test_round_trip_commands_and_events() -> None:
    cmd = control.parse_command(control.encode("arm", mode="harvest", share=0.5, socket="/x/fill-a.sock"))
    assert cmd.type == "arm" and cmd["mode"] == "harvest" and cmd["share"] == 0.5
    ev = control.parse_event(control.encode("step", start_ns=1, end_ns=5, flops=2.0, samples=3,
                                            bubble_seq=7, signal_ns=0))
    assert ev.type == "step" and ev["end_ns"] == 5 and ev.get("bubble_seq") == 7
    assert control.parse_event(control.encode("finished")).type == "finished"
    synced = control.parse_event(control.encode("step", start_ns=10, end_ns=50, flops=1.0, sync_ns=30))
    assert synced["sync_ns"] == 30
    assert "sync_ns" not in ev.fields  # optional: runtimes before it are still understood


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b"garbage\n", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"type": "explode"}', "unknown command type"),
        (b'{"type": "arm"}', "missing field 'mode'"),
        (b'{"type": "arm", "mode": "sometimes"}', "arm.mode must be one of"),
        (b'{"type": "share", "share": 2}', "share must be in [0, 1]"),
        (b'{"type": "share", "share": true}', "must be int or float"),
        (b'{"type": "share", "share": 2, "future": 1}', "share must be in [0, 1]"),  # known fields still checked
        (b'{"type": "limits", "tail_risk": 0.6}', "limits.tail_risk must be the accepted chance"),
        (b'{"type": "limits", "tail_risk": -0.1}', "from 0 (never start one) to 0.5"),
        (b'{"type": "limits", "tail_risk": "0.1"}', "limits.tail_risk must be int or float"),
        (b'{"type": "limits", "tail_risk": true}', "limits.tail_risk must be int or float"),
        (b'{"type": "limits", "tail_risk": NaN}', "limits.tail_risk must be finite"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"type": "share", "share": ' + b"[" * 60_000 + b"}", "nested too deeply"),  # not a RecursionError
    ],
)
def test_bad_commands_are_rejected_with_a_reason(line: bytes, needle: str) -> None:
    with pytest.raises(control.ControlError, match=None) as err:
        control.parse_command(line)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b'{"type": "state", "state": "DANCING"}', "state.state must be one of"),
        (b'{"type": "step", "start_ns": 5, "end_ns": 1, "flops": 0}', "ends before it starts"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 2, "flops": NaN}', "must be finite"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 2, "flops": -1.5}', "step.flops must be >= 0"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 2, "flops": ' + b"9" * 400 + b"}", "step.flops must be finite"),
        (b'{"type": "profile", "step_s": 0}', "step_s must be > 0"),
        (b'{"type": "step_begin", "t_ns": "now", "bubble_seq": 1}', "t_ns must be int"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 5, "flops": 0, "sync_ns": 9}',
         "sync_ns must be between 0 and the step's duration (4 ns), got 9"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 5, "flops": 0, "sync_ns": -1}', "sync_ns must be between 0"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 5, "flops": 0, "sync_ns": 1.5}', "sync_ns must be int"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 5, "flops": 0, "sync_ns": true}', "sync_ns must be int"),
        (b'{"type": "step", "start_ns": 1, "end_ns": 5, "flops": 0, "sync_ns": "3"}', "sync_ns must be int"),
        # A fill process's line within the size limit, deeper than the JSON parser's stack: not a RecursionError,
        # which would have stopped the agent's loop.
        (b'{"type": "step", "start_ns": ' + b"[" * 60_000, "nested too deeply"),
    ],
)
def test_bad_events_are_rejected_with_a_reason(line: bytes, needle: str) -> None:
    with pytest.raises(control.ControlError) as err:
        control.parse_event(line)
    assert needle in str(err.value)


def test_modes_are_fill_mode_labels_on_the_wire_and_members_in_code() -> None:
    assert control.MODES == ("harvest", "naive")  # the wire format is unchanged
    assert control.parse_mode("naive", "arm.mode") is FillMode.NAIVE
    assert control.parse_mode("harvest") is FillMode.HARVEST
    ev = control.parse_event(control.encode("step", start_ns=1, end_ns=2, flops=0, mode=FillMode.NAIVE.label))
    assert control.parse_mode(ev["mode"]) is FillMode.NAIVE
    # "off" is a FillMode but not a mode a fill process is armed in: the agent disarms instead.
    for bad, what in (("off", "arm.mode"), ("Harvest", "step.mode"), (2, "mode")):
        with pytest.raises(control.ControlError, match=rf"{what} must be one of harvest, naive, got {bad!r}"):
            control.parse_mode(bad, what)
    with pytest.raises(control.ControlError, match=r"step\.mode must be one of harvest, naive, got 'off'"):
        control.parse_event(b'{"type": "step", "start_ns": 1, "end_ns": 2, "flops": 0, "mode": "off"}')


def test_line_buffer_splits_joins_and_cuts_overlong_lines() -> None:
    buf = control.LineBuffer()
    assert list(buf.feed(b'{"type":"fini')) == []
    assert list(buf.feed(b'shed"}\n\n{"type":"stop"}\n')) == [b'{"type":"finished"}', b'{"type":"stop"}']
    out = list(buf.feed(b"x" * (control.MAX_LINE_BYTES + 10)))
    assert len(out) == 1
    with pytest.raises(control.ControlError):
        control.parse_event(out[0])
    # the rest of the overlong line is discarded; the next line parses
    assert list(buf.feed(b"yyy\n" + control.encode("finished"))) == [b'{"type":"finished"}']


@pytest.mark.parametrize("line", [
    '{"type": "profile", "step_s": 0.001, "sizes": [[0, 0.001]]}',
    '{"type": "profile", "step_s": 0.001, "sizes": [[2, 0.001], [1, 0.002]]}',
    '{"type": "profile", "step_s": 0.001, "sizes": [[1, 0]]}',
    '{"type": "profile", "step_s": 0.001, "sizes": [[1]]}',
    '{"type": "profile", "step_s": 0.001, "sizes": [[true, 0.001]]}',
    '{"type": "profile", "step_s": 0.001, "sizes": "1,2"}',
    '{"type": "step", "start_ns": 1, "end_ns": 2, "flops": 1.0, "size": 0}',
])
def test_bad_step_sizes_in_events_are_refused_with_a_reason(line: str) -> None:
    with pytest.raises(control.ControlError, match="size"):
        control.parse_event(line)
    ok = control.parse_event('{"type": "profile", "step_s": 0.001, "sizes": [[1, 0.001], [4, 0.003]]}')
    assert ok["sizes"] == [[1, 0.001], [4, 0.003]]


def test_fields_a_newer_peer_adds_are_left_out_and_named_while_known_ones_are_still_checked() -> None:
    cmd = control.parse_command(b'{"type": "arm", "mode": "harvest", "priority": 3, "colour": "red"}')
    assert cmd.fields == {"mode": "harvest"} and cmd.unknown == ("colour", "priority")
    ev = control.parse_event(control.encode("step", start_ns=1, end_ns=5, flops=2.0, gate="tail", energy_j=0.1))
    assert ev.unknown == ("energy_j",) and "energy_j" not in ev.fields and ev["gate"] == "tail"
    assert control.parse_command(b'{"type": "stop"}').unknown == ()
    with pytest.raises(control.ControlError, match="unknown command type 'pause'"):  # a new type is still refused
        control.parse_command(b'{"type": "pause", "for_ms": 3}')
    with pytest.raises(control.ControlError, match="missing field 'mode'"):
        control.parse_command(b'{"type": "arm", "mood": "harvest"}')


def test_the_handshake_says_each_sides_control_version() -> None:
    hello = control.parse_hello(control.encode("hello", uid="u", attempt=0, protocol=control.VERSION))
    assert control.peer_version(hello) == control.VERSION
    welcome = control.parse_reply(control.encode("welcome", job="j", socket="/s", stage=0, protocol=7))
    assert control.peer_version(welcome) == 7  # a newer agent: its version is read, not refused here
    # A peer that sends no version predates the field.
    assert control.peer_version(control.parse_hello(control.encode("hello", uid="u", attempt=0))) == \
        control.UNVERSIONED
    assert control.MIN_VERSION <= control.UNVERSIONED <= control.VERSION


@pytest.mark.parametrize(("line", "needle"), [
    (control.encode("hello", uid="u", attempt=0, protocol=0), "hello.protocol must be a version >= 1"),
    (control.encode("hello", uid="u", attempt=0, protocol="3"), "hello.protocol must be int"),
    (control.encode("welcome", job="j", socket="/s", stage=0, protocol=-2), "welcome.protocol must be a version"),
])
def test_a_handshake_version_that_is_no_version_is_refused(line: bytes, needle: str) -> None:
    with pytest.raises(control.ControlError, match=needle):
        if b"hello" in line:
            control.parse_hello(line)
        else:
            control.parse_reply(line)


# -- gang jobs (v4) ------------------------------------------------------------------------------------------------
def test_arm_carries_a_gangs_sockets_its_own_first() -> None:
    cmd = control.parse_command(control.encode("arm", mode="harvest", socket="/r/a.sock",
                                               sockets=["/r/a.sock", "/r/b.sock"]))
    assert cmd["sockets"] == ["/r/a.sock", "/r/b.sock"]
    assert control.VERSION >= 4  # gangs came with v4


@pytest.mark.parametrize(("sockets", "match"), [
    ([], "1 to 16 distinct"),
    (["relative.sock"], "absolute"),
    (["/r/a.sock", "/r/a.sock"], "distinct"),
    (["/r/a.sock", 3], "absolute"),
    ([f"/r/{i}.sock" for i in range(17)], "1 to 16"),
    (["/r/b.sock", "/r/a.sock"], "start with the process's own GPU's socket"),
    ("/r/a.sock", "must be list"),
])
def test_a_bad_sockets_list_in_arm_is_refused(sockets: object, match: str) -> None:
    with pytest.raises(control.ControlError, match=match):
        control.parse_command(control.encode("arm", mode="harvest", socket="/r/a.sock", sockets=sockets))


def test_hello_says_the_gang_rank_and_welcome_the_gangs_sockets() -> None:
    hello = control.parse_hello(control.encode("hello", uid="u", attempt=0, gang_rank=1, protocol=4))
    assert hello["gang_rank"] == 1
    for bad in (-1, 16, "1", True):
        with pytest.raises(control.ControlError, match="gang_rank"):
            control.parse_hello(control.encode("hello", uid="u", attempt=0, gang_rank=bad))
    welcome = control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0,
                                                 sockets=["/r/a.sock", "/r/b.sock"]))
    assert welcome["sockets"] == ["/r/a.sock", "/r/b.sock"]
    with pytest.raises(control.ControlError, match="own GPU"):
        control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0, sockets=["/r/b.sock"]))
