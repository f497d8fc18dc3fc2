"""What learning the sender of each hook datagram costs the agent: ``recv`` against ``recv_with_pid``.

Since 2026-11-25 the agent's stage sockets set ``SO_PASSCRED`` and read every datagram with ``recvmsg``, so the
kernel names the training's process (``bubbles.agent.server.recv_with_pid``; the agent asks the MPS daemon whether
that process is a client). This times, in one process and one run, a burst of ``--datagrams`` BUBBLE_START-sized
datagrams sent and then received both ways: a socket without ``SO_PASSCRED`` read with ``recv`` (before), and one
with it read with ``recv_with_pid`` (now). Rounds alternate the two (ABAB), so drift of the machine hits both alike.
Per round: nanoseconds per datagram spent sending (the hook's side) and receiving (the agent's); over rounds: the
medians, and the added nanoseconds per round with a distribution-free 95% interval for their median (6 rounds or
more).

    .venv/bin/python benchmarks/datagram_credentials.py [--rounds 8] [--datagrams 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bubbles.agent.server import recv_with_pid
from bubbles.core import wire
from bubbles.core.stats import median_interval


def _batch() -> int:
    """Datagrams sent before they are received: 8, within the queue a datagram socket holds
    (``net.unix.max_dgram_qlen``, 10 on the project's VM)."""
    try:
        qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    except (OSError, ValueError):
        return 8
    return max(1, min(8, qlen - 1))


def _burst(path: Path, n: int, credentials: bool) -> tuple[float, float]:
    """Send ``n`` datagrams to a socket bound at ``path``, receiving them as they queue; seconds per datagram spent
    sending (the hook's side: the training's, or its helper thread's) and receiving (the agent's)."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
    if credentials:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    path.unlink(missing_ok=True)
    rx.bind(str(path))
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.settimeout(5.0)  # a full queue fails the run rather than hanging it
    batch = _batch()
    data = wire.encode_bubble_start(0, 1, 2, time.monotonic_ns(), time.monotonic_ns() + 5_000_000)
    size = wire.MAX_DATAGRAM_BYTES + 1
    clock = time.perf_counter_ns
    send_ns = recv_ns = 0
    try:
        sent = 0
        while sent < n:
            chunk = min(batch, n - sent)
            t0 = clock()
            for _ in range(chunk):
                tx.sendto(data, str(path))
            t1 = clock()
            if credentials:
                for _ in range(chunk):
                    recv_with_pid(rx, size)
            else:
                for _ in range(chunk):
                    rx.recv(size)
            send_ns += t1 - t0
            recv_ns += clock() - t1
            sent += chunk
        return send_ns / n / 1e9, recv_ns / n / 1e9
    finally:
        tx.close()
        rx.close()


def run(rounds: int, datagrams: int) -> dict[str, Any]:
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="creds-") as tmp:
        path = Path(tmp) / "agent.sock"
        _burst(path, 1000, True)  # warm-up
        _burst(path, 1000, False)
        for r in range(rounds):
            for credentials in ((False, True) if r % 2 == 0 else (True, False)):
                times[credentials].append(_burst(path, datagrams, credentials))
            (bs, br), (ns, nr) = times[False][-1], times[True][-1]
            print(f"round {r + 1}/{rounds}: send {bs * 1e9:.0f} -> {ns * 1e9:.0f} ns, receive {br * 1e9:.0f} -> "
                  f"{nr * 1e9:.0f} ns per datagram", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rounds": rounds, "datagrams": datagrams}
    for i, side in enumerate(("send", "receive")):
        before = [t[i] * 1e9 for t in times[False]]
        now = [t[i] * 1e9 for t in times[True]]
        added = [b - a for a, b in zip(before, now, strict=True)]
        out[side] = {"before_ns": before, "now_ns": now, "before_median_ns": statistics.median(before),
                     "now_median_ns": statistics.median(now), "added_median_ns": statistics.median(added),
                     "added_interval_ns": median_interval(added) if len(added) >= 6 else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="datagram_credentials.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="rounds, each timing both (default 8)")
    p.add_argument("--datagrams", type=int, default=20_000, help="datagrams per burst (default 20000)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.datagrams < 1:
        p.error("--rounds and --datagrams must be >= 1")
    result = run(args.rounds, args.datagrams)
    for side, who in (("send", "the hook's sendto"), ("receive", "the agent's receive")):
        r = result[side]
        iv = r["added_interval_ns"]
        print(f"{who}: {r['before_median_ns']:.0f} ns before, {r['now_median_ns']:.0f} ns with SO_PASSCRED "
              f"(medians of {args.rounds} rounds); added {r['added_median_ns']:+.0f} ns"
              + (f" [{iv[0]:+.0f}, {iv[1]:+.0f}]" if iv else ""))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
