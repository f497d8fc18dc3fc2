"""A DeepSpeed op build killed part-way must not hang later launches (bubbles.demo.ds_ops)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bubbles.demo.ds_ops import OP, prepare_shm_op


def test_a_baton_left_by_a_dead_build_is_removed_before_loading(tmp_path: Path) -> None:
    build = tmp_path / OP
    build.mkdir()
    (build / "lock").write_text("")
    said: list[str] = []
    seen: list[bool] = []
    prepare_shm_op(build, lambda: seen.append((build / "lock").exists()), said.append)
    assert seen == [False]  # gone before the load, which would otherwise wait on it
    assert any("killed part-way" in s for s in said) and any("building" in s for s in said)


def test_a_built_op_loads_quietly_and_a_missing_directory_is_made(tmp_path: Path) -> None:
    build = tmp_path / "ext" / OP
    said: list[str] = []
    calls: list[int] = []
    prepare_shm_op(build, lambda: calls.append(1), said.append)
    assert build.is_dir() and calls == [1] and [s for s in said if "building" in s]
    (build / f"{OP}.so").write_bytes(b"")
    said.clear()
    prepare_shm_op(build, lambda: calls.append(2), said.append)
    assert calls == [1, 2] and said == []


def test_a_live_build_elsewhere_is_waited_for_and_its_baton_left_alone(tmp_path: Path) -> None:
    """Another process holds the flock and is building (its baton exists): this one waits, and loads after it."""
    build = tmp_path / OP
    build.mkdir()
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, pathlib, time
        fd = os.open({str(tmp_path / (OP + ".bubbles-lock"))!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        baton = pathlib.Path({str(build / "lock")!r}); baton.write_text("")
        pathlib.Path({str(ready)!r}).write_text("")
        time.sleep(1.0)
        baton.unlink()  # the build finishes and takes its baton away, as torch does
        """)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.01)
        said: list[str] = []
        loaded_at: list[float] = []
        started = time.monotonic()
        worker = threading.Thread(target=prepare_shm_op, args=(build, lambda: loaded_at.append(time.monotonic()),
                                                              said.append))
        worker.start()
        worker.join(30)
        assert not worker.is_alive()
        assert holder.wait(30) == 0
    finally:
        holder.kill()
    assert any("waiting for another process" in s for s in said)
    assert not any("killed part-way" in s for s in said)  # a live build's baton is not taken for a dead one
    assert loaded_at and loaded_at[0] - started > 0.3  # it waited for the holder


def test_a_failing_load_reaches_the_caller(tmp_path: Path) -> None:
    def boom() -> None:
        raise RuntimeError("ninja failed")

    with pytest.raises(RuntimeError, match="ninja failed"):
        prepare_shm_op(tmp_path / OP, boom, lambda _: None)
    prepare_shm_op(tmp_path / OP, lambda: None, lambda _: None)  # the flock went with the failed call


def test_deepspeed_builds_past_a_stale_baton_with_the_real_op(tmp_path: Path) -> None:
    """With real DeepSpeed: a stale baton in the build directory, then what ``init_distributed`` does on CPU. Without
    ``prepare_deepspeed_cpu_ops`` DeepSpeed's own ``build_shm_op`` would wait on the baton until the timeout."""
    from torch.utils import cpp_extension

    ext = tmp_path / "torch_extensions"
    ours = Path(cpp_extension._get_build_directory(OP, verbose=False))
    build = ext / OP  # torch uses $TORCH_EXTENSIONS_DIR as the root itself
    if any(ours.glob("*.so")):  # copy this machine's build (mtimes kept), so that ninja has nothing to do
        shutil.copytree(ours, build, ignore=shutil.ignore_patterns("lock"))
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").write_text("")
    script = textwrap.dedent("""
        from bubbles.demo.ds_ops import prepare_deepspeed_cpu_ops
        prepare_deepspeed_cpu_ops()
        from deepspeed.comm.torch import build_shm_op
        op = build_shm_op()
        print("loaded", op is not None)
        """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded True" in done.stdout and "killed part-way" in done.stderr
    assert not (build / "lock").exists() and any(build.glob("*.so"))
