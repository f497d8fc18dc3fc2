"""The demo's training leaves DeepSpeed's CPU shared-memory op unbuilt (bubbles.demo.ds_ops), with real DeepSpeed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bubbles.demo.ds_ops import OP
from bubbles.demo.orchestrate.processes import free_port

INIT = textwrap.dedent("""
    import os, sys
    {before}
    import deepspeed, torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed import comm
    backend = comm.comm.cdb
    print("shm op", getattr(backend, "shm_comm_op", "absent"))
    print("world", dist.get_world_size())
    """)


def world_of_one(tmp_path: Path) -> dict[str, str]:
    """The environment of a one-rank CPU launch, with an empty extensions directory."""
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def init_distributed(tmp_path: Path, before: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``init_distributed`` on CPU in a fresh process (world of one), with an empty extensions directory."""
    return subprocess.run([sys.executable, "-c", INIT.format(before=before)], env=world_of_one(tmp_path),
                          capture_output=True, text=True, timeout=timeout_s)


def test_init_distributed_builds_no_op_after_the_skip_and_gloo_carries_on(tmp_path: Path) -> None:
    done = init_distributed(tmp_path, "from bubbles.demo.ds_ops import skip_unused_cpu_ops\n"
                                      "assert skip_unused_cpu_ops()", timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shm op None" in done.stdout and "world 1" in done.stdout, done.stdout
    assert not (tmp_path / "ext" / OP).exists(), "DeepSpeed started a build of the op"
    assert "built successfully" not in done.stdout


def test_without_the_skip_deepspeed_would_build_the_op(tmp_path: Path) -> None:
    """The skip is what stops the build: the same launch without it starts one (stopped as soon as it shows, with
    the compiler it started: the process runs in a session of its own, killed whole)."""
    import deepspeed.ops

    if not deepspeed.ops.__compatible_ops__.get(OP, False):
        pytest.skip(f"DeepSpeed does not build {OP} on this machine: there is no build for the skip to stop")
    proc = subprocess.Popen([sys.executable, "-c", INIT.format(before="")], env=world_of_one(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ext" / OP).exists():
            assert proc.poll() is None, "init_distributed ended without building the op: the skip proves nothing"
            assert time.monotonic() < deadline, "no build of the op started within 120 s"
            time.sleep(0.1)
    finally:
        kill_session(proc.pid)  # ninja and the compilers with it (ninja gives each job a process group of its own)
        proc.wait()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``, until none is left."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # after the name: state, ppid, pgrp, session
                    members.append(int(stat.parent.name))  # (a zombie is dead already: its parent reaps it)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def test_a_deepspeed_without_the_table_is_left_to_build_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import deepspeed.ops

    from bubbles.demo.ds_ops import skip_unused_cpu_ops

    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", ("not", "a", "dict"), raising=False)
    assert skip_unused_cpu_ops() is False
    assert f"could not tell DeepSpeed to skip its {OP} op" in capsys.readouterr().err
