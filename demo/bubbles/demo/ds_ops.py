"""DeepSpeed's CPU shared-memory op, built so that a build killed part-way cannot hang every later launch.

On the CPU accelerator DeepSpeed JIT-builds ``deepspeed_shm_comm`` in every rank at ``init_distributed``, through
``torch.utils.cpp_extension.load``. That build is guarded by torch's ``FileBaton``: a ``lock`` file in the build
directory that only the process which created it removes. A rank killed during the build (a Ctrl-C in the first
``make demo`` on a machine, which builds for about 30 s) leaves the file behind, and from then on every launch on
that machine waits on it forever, printing nothing.

``prepare_shm_op`` builds (or loads) the op before DeepSpeed asks for it, under an ``flock`` on a file beside the
build directory. The kernel releases an flock when its holder dies, so the process that holds it and still finds a
baton knows the baton was left by a build that died, and removes it. DeepSpeed's own call then finds the op loaded
(its op builder keeps loaded ops per process) and never touches the baton.

What it cannot tell apart: a build of the same op, in the same build directory, by a process outside bubbles that
is running at that very moment. Its baton would be taken for a dead one.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Callable
from pathlib import Path

OP = "deepspeed_shm_comm"


def prepare_shm_op(build_dir: Path, load: Callable[[], object], say: Callable[[str], None]) -> None:
    """Run ``load`` (build or load the op in ``build_dir``) under the flock, removing a baton a dead build left."""
    build_dir.mkdir(parents=True, exist_ok=True)
    lock_path = build_dir.with_name(build_dir.name + ".bubbles-lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process to finish building {build_dir.name} ({lock_path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        baton = build_dir / "lock"
        if baton.exists():
            say(f"removing {baton}: a build of {build_dir.name} was killed part-way and left it (it would make "
                "this launch wait forever)")
            baton.unlink(missing_ok=True)
        if not any(build_dir.glob("*.so")):
            say(f"building DeepSpeed's {build_dir.name} op into {build_dir} (once per machine; about 30 s on 2 cores)")
        load()
    finally:
        os.close(fd)  # releases the flock


def prepare_deepspeed_cpu_ops() -> None:
    """``prepare_shm_op`` for the op DeepSpeed's CPU accelerator will build, if it will build one. Fails open: if
    this goes wrong, it says so and leaves the op to DeepSpeed, as without it."""
    def say(message: str) -> None:
        print(f"bubbles: {message}", file=sys.stderr, flush=True)

    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from torch.utils import cpp_extension

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or builder.NAME != OP or not deepspeed.ops.__compatible_ops__.get(OP, False):
            return  # DeepSpeed will not build it either
        build_dir = Path(cpp_extension._get_build_directory(OP, verbose=False))
        prepare_shm_op(build_dir, builder.load, say)
    except Exception as exc:  # the launch goes on as without this
        say(f"could not prepare DeepSpeed's {OP} op ({type(exc).__name__}: {exc}); DeepSpeed builds it itself")
