"""Waits inside DeepSpeed's instructions: the collectives of ``OptimizerStep``, ``ReduceGrads`` and ``ReduceTiedGrads``.

With gradient clipping on (DeepSpeed's usual 1.0), ``OptimizerStep`` starts with the gradient norm's all-reduce over
every stage of the pipeline: a stage that finished its backward passes early waits there for the last one, and that
is where the pipeline's drain bubble sits. Overflow checks (fp16), the data-parallel all-reduces of ``ReduceGrads`` and
the tied weights' of ``ReduceTiedGrads`` wait on other ranks the same way. The instruction as a whole is not a wait (the
optimizer's update is compute), so each collective inside it is timed on its own.

DeepSpeed sends every collective through one backend object, ``deepspeed.comm.comm.cdb``. ``Collectives`` shadows that
object's collective methods with instance attributes, as the hook does the engine's (never DeepSpeed's classes or
files), for as long as an instrumented engine is attached in the process, and restores them when the last one
detaches. While an instrumented engine runs one of ``HOST_INSTRUCTIONS`` on its thread, a blocking collective it calls
is handed to that engine's wait wrapper (timed, profiled and signalled like a receive, its record named
``<instruction>.<op>``); anywhere else, on any other thread, and for ``async_op=True`` calls, the call goes straight
through after one thread-local read. Where the backend is not there (another DeepSpeed), nothing is shadowed and the
hook says so once: those waits stay unseen, nothing else changes.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

# Instructions whose collectives are timed one by one (the instruction itself is compute around them).
HOST_INSTRUCTIONS = frozenset({"OptimizerStep", "ReduceGrads", "ReduceTiedGrads"})
# The backend's blocking collectives that wait on other ranks (isend/irecv and async_op=True calls return at once).
OPS = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "broadcast", "all_gather",
       "all_gather_into_tensor", "reduce_scatter_tensor", "barrier", "send", "recv")
SEPARATOR = "."


def collective_name(instruction: str, op: str) -> str:
    """The record name of collective ``op`` called inside ``instruction``: ``OptimizerStep.all_reduce``."""
    return f"{instruction}{SEPARATOR}{op}"


def is_collective(name: str) -> bool:
    """Whether a record name is a collective inside one of ``HOST_INSTRUCTIONS``."""
    host, sep, op = name.partition(SEPARATOR)
    return bool(sep) and host in HOST_INSTRUCTIONS and op in OPS


class _Active(threading.local):
    """The wait wrappers (op -> wrapper) of the host instruction running on this thread, if any."""

    table: dict[str, Callable[..., Any]] | None = None


ACTIVE = _Active()


def _async_index(method: Any) -> int | None:
    """The position of ``async_op`` among ``method``'s positional parameters (None: it has none)."""
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("async_op") if "async_op" in params else None


class Collectives:
    """The process's one interposer on DeepSpeed's communication backend; see the module docstring.

    ``acquire`` installs it on the first call (and counts); ``release`` removes it with the last. ``originals`` holds
    the backend's own bound methods, around which each instrumentation builds its wait wrappers."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        self.backend: Any = None
        self.originals: dict[str, Callable[..., Any]] = {}
        self._installed: dict[str, Callable[..., Any]] = {}
        self._users = 0

    def acquire(self, backend: Any) -> None:
        """Shadow ``backend``'s collectives (first user), or count one more user of the same backend.

        Raises ``RuntimeError`` if ``backend`` is None or has none of ``OPS``, or if another backend is already
        shadowed (two DeepSpeed communication backends in one process)."""
        with self._lock:
            if self._users:
                if backend is not self.backend:
                    raise RuntimeError("another DeepSpeed communication backend is already interposed")
                self._users += 1
                return
            if backend is None:
                raise RuntimeError("DeepSpeed's communication backend (deepspeed.comm.comm.cdb) is not initialised")
            originals = {op: getattr(backend, op) for op in OPS if callable(getattr(backend, op, None))}
            if not originals:
                raise RuntimeError(f"{type(backend).__name__} has none of the collectives {', '.join(OPS)}")
            installed = {op: _interposed(op, fn, _async_index(fn)) for op, fn in originals.items()}
            d = backend.__dict__
            for op, fn in installed.items():
                d[op] = fn
            self.backend, self.originals, self._installed, self._users = backend, originals, installed, 1

    def release(self) -> None:
        """One user fewer; the last restores the backend (only the attributes still ours)."""
        with self._lock:
            if not self._users:
                return
            self._users -= 1
            if self._users:
                return
            d = self.backend.__dict__
            for op, fn in self._installed.items():
                if d.get(op) is fn:
                    del d[op]
            self.backend, self.originals, self._installed = None, {}, {}

    @property
    def users(self) -> int:
        return self._users


def _interposed(op: str, original: Callable[..., Any], async_index: int | None) -> Callable[..., Any]:
    active = ACTIVE

    def collective(*args: Any, **kwargs: Any) -> Any:
        table = active.table
        if table is None:
            return original(*args, **kwargs)
        if kwargs.get("async_op") or (async_index is not None and len(args) > async_index and args[async_index]):
            return original(*args, **kwargs)  # returns a Work at once: its wait is the caller's, later
        active.table = None  # a collective the backend makes inside this one is part of it, not another wait
        try:
            return table[op](*args, **kwargs)
        finally:
            active.table = table

    collective.__name__ = op
    collective.__wrapped__ = original  # type: ignore[attr-defined]
    return collective


COLLECTIVES = Collectives()


def deepspeed_backend() -> Any:
    """DeepSpeed's communication backend object, or None where this DeepSpeed has none."""
    try:
        from deepspeed.comm import comm
    except Exception:
        return None
    return getattr(comm, "cdb", None)


__all__ = ["ACTIVE", "COLLECTIVES", "HOST_INSTRUCTIONS", "OPS", "Collectives", "collective_name",
           "deepspeed_backend", "is_collective"]
