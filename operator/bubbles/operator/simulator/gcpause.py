"""Python's cycle collector paused while the simulator makes its millions of objects.

The collector runs every few hundred new container objects and, every so often, walks all of them: a week of 100,000
GPUs makes a job, an outcome, a placement and a heap entry per fill job (millions), none of them in a reference cycle,
and the walks cost about a fifth of the run (to be measured again on a quiet machine). Pausing it changes no result;
what would be freed is freed when it runs again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cycle collector off inside the block, back as it was after it (also where the block raises)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
