"""The reference the bubble signal is measured against: a gRPC unary round trip on localhost.

gRPC is what a control plane would naturally use (FreeRide's manager drives side tasks over RPC), so
the bubble-signal benchmark reports its latency as a ratio to this, measured in the same run."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from bubbles.core.wire import SIGNAL_BYTES

METHOD = "/bubbles.bench.Echo/Ping"


def _serve(port_queue: Any, stop: Any) -> None:
    from concurrent import futures

    import grpc

    def ping(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "bubbles.bench.Echo",
        {"Ping": grpc.unary_unary_rpc_method_handler(ping, request_deserializer=None,
                                                      response_serializer=None)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    stop.wait()
    server.stop(0)


def grpc_round_trips_us(count: int = 2000, gap_s: float = 0.001, warmup: int = 100) -> list[float]:
    """Round-trip times (microseconds) of ``count`` unary calls to a server in another process."""
    import grpc

    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(port_queue, stop), daemon=True)
    server.start()
    try:
        port = port_queue.get(timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            ping = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
            payload = b"x" * SIGNAL_BYTES  # the size of a bubble signal
            out = []
            for i in range(warmup + count):
                t0 = time.perf_counter_ns()
                ping(payload, timeout=5)
                dt = (time.perf_counter_ns() - t0) / 1000
                if i >= warmup:
                    out.append(dt)
                time.sleep(gap_s)
            return out
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
