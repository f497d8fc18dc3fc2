"""Running a whole operator replica in a test: its own thread and event loop, stopped on request."""

from __future__ import annotations

import asyncio
import threading
import time

from bubbles.operator.shell import Operator


class OperatorThread:
    """The operator in a thread with its own event loop, as it would be in its own process: kopf cancels every
    task of its loop when it exits, which must not include the test's."""

    def __init__(self, op: Operator) -> None:
        self.op = op
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            await self.op.run(self.stop)

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:
            self.error = exc

    def wake(self) -> None:
        self.loop.call_soon_threadsafe(self.op.wake.set)

    def close(self, timeout_s: float = 20.0) -> float:
        t0 = time.monotonic()
        while self.stop is None and self.thread.is_alive():
            time.sleep(0.01)
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the operator did not stop"
        assert self.error is None, repr(self.error)
        return time.monotonic() - t0
