"""Fill-job spec parsing and the ``bubbles agent`` command line, run as a real process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bubbles.core import paths, wire
from bubbles.core.api import FillInterface, SpecError, load_spec, parse_duration, parse_quantity, parse_spec
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey

ROOT = Path(__file__).parent.parent
GOOD = {"name": "job", "entry": "pkg.mod:Job"}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "must be a mapping"),
        ({"entry": "a:B"}, "missing field 'name'"),
        ({**GOOD, "name": "Bad_Name"}, "field 'name'"),
        ({**GOOD, "interface": "sometimes"}, "field 'interface' must be one of iterative, imperative"),
        ({**GOOD, "kind": "iterative"}, "write 'interface: iterative'"),
        ({**GOOD, "kind": "finetune"}, "field 'kind' must be one of training, batch-inference"),
        ({"name": "job"}, "missing field 'entry'"),
        ({**GOOD, "entry": "no-colon"}, "field 'entry' must look like 'package.module:ClassName'"),
        ({**GOOD, "memory": "lots"}, "field 'memory' must be bytes or a Kubernetes quantity"),
        ({**GOOD, "memory": -1}, "field 'memory' must be >= 0"),
        ({**GOOD, "step_time": "soon"}, "field 'step_time' must be a duration"),
        ({**GOOD, "step_time": 0}, "field 'step_time' must be a duration > 0"),
        ({**GOOD, "steps": 0}, "field 'steps' must be an integer >= 1"),
        ({**GOOD, "stage": -1}, "field 'stage' must be an executor index"),
        ({**GOOD, "init_timeout": "forever"}, "field 'init_timeout' must be a duration like 30m, 1h"),
        ({**GOOD, "step_time": "5m"}, "field 'step_time' must be a duration like 2ms"),
        ({**GOOD, "init_timeout": "25h"}, "field 'init_timeout' must be more than 0 and at most a day"),
        ({**GOOD, "init_timeout": 0}, "field 'init_timeout' must be a duration > 0"),
        ({**GOOD, "args": [1]}, "field 'args' must be a mapping"),
        ({**GOOD, "nodes": [{"memory": 1}]}, "field 'nodes[0]' must be a mapping with 'duration'"),
        ({**GOOD, "command": ["x"]}, "field 'command' is for imperative jobs"),
        ({"name": "j", "interface": "imperative", "command": []}, "field 'command' must be a non-empty list"),
        ({**GOOD, "flops_per_step": -1}, "field 'flops_per_step' must be a number >= 0"),
        ({**GOOD, "flops_per_step": "2 GFLOP"}, "field 'flops_per_step' must be a number >= 0"),
        ({**GOOD, "flops_per_step": True}, "field 'flops_per_step' must be a number >= 0"),
        ({**GOOD, "flops_per_step": float("nan")}, "field 'flops_per_step' must be a number >= 0"),
        ({**GOOD, "colour": "blue"}, "unknown field(s) colour"),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(data: object, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(data, "job.yaml")
    assert needle in str(err.value) and str(err.value).startswith("job.yaml: ")


def test_spec_units_and_defaults() -> None:
    assert parse_quantity("512Mi", "m") == 512 * 2**20 and parse_quantity("2Gi", "m") == 2 * 2**30
    assert parse_quantity("1G", "m") == 10**9 and parse_quantity(4096, "m") == 4096
    assert parse_duration("2ms", "t") == pytest.approx(0.002) and parse_duration("0.002", "t") == 0.002
    assert parse_duration("500us", "t") == pytest.approx(5e-4)
    # Minutes and hours (as in Go) for timeouts only: a step time of "5m" is a slip (milli?), not five minutes.
    assert parse_duration("20m", "t", long=True) == 1200 and parse_duration("1.5h", "t", long=True) == 5400
    with pytest.raises(SpecError, match=r"like 2ms, 500us or 0\.002"):
        parse_duration("5m", "t")
    nodes = [{"duration": "1ms"}, {"duration": 0.002, "memory": "2Mi"}]
    assert parse_spec({**GOOD, "flops_per_step": 2}).flops_per_step == 2.0 and parse_spec(GOOD).flops_per_step is None
    s = parse_spec({**GOOD, "memory": "1Mi", "nodes": nodes})
    assert s.interface is FillInterface.ITERATIVE and s.kind is None and s.args == {} and s.stage is None
    assert [n.memory_bytes for n in s.nodes] == [2**20, 2 * 2**20]
    assert s.gating_step_s == pytest.approx(0.003)
    imp = parse_spec({"name": "imp", "interface": "imperative", "command": ["sleep", "10"]})
    assert imp.command == ("sleep", "10") and imp.entry is None


def test_load_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read fill-job spec"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML/JSON"):
        load_spec(bad)
    js = tmp_path / "job.json"
    js.write_text(json.dumps({**GOOD, "memory": "1Ki"}))
    assert load_spec(js).memory_bytes == 1024


def _agent(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bubbles.cli", "agent", *args], capture_output=True,
                          text=True, timeout=60, **kw)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--executors", "0"], "--executors must be >= 1"),
        (["--fill-job", "/no/such/spec.yaml"], "cannot read fill-job spec /no/such/spec.yaml"),
        (["--training", "Not_Valid"], "training name 'Not_Valid' is not valid"),
        (["--start-timeout", "30"], "--start-timeout only applies with --exit-when-done"),
        (["--exit-when-done", "--start-timeout", "-1"], "--start-timeout must be > 0 seconds"),
        (["--exit-when-done", "--start-timeout", "soon"], "argument --start-timeout: invalid float value: 'soon'"),
        (["--exit-when-done=yes"], "--exit-when-done/--no-exit-when-done: ignored explicit argument 'yes'"),
        (["--exit-when-done", "--cluster", "--node", "n"], "--exit-when-done is for local mode"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(tmp_path: Path, args: list[str], needle: str) -> None:
    r = _agent("--run-dir", str(tmp_path), *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_cli_invalid_spec_file_exits_2(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: job\nentry: a:B\nmemory: plenty\n")
    r = _agent("--run-dir", str(tmp_path), "--fill-job", str(spec))
    assert r.returncode == 2 and "field 'memory'" in r.stderr
    spec.write_text("name: job\nentry: a:B\nstage: 3\n")
    r = _agent("--run-dir", str(tmp_path), "--fill-job", str(spec))
    assert r.returncode == 2 and "asks for stage 3" in r.stderr


@contextlib.contextmanager
def ready_agent(*flags: str, ready: Path) -> Iterator[subprocess.Popen[str]]:
    """``bubbles agent FLAGS --ready-file READY`` as a process, once ready; SIGTERM and a clean exit after."""
    proc = subprocess.Popen([sys.executable, "-m", "bubbles.cli", "agent", *flags, "--ready-file", str(ready)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "agent did not get ready"
            time.sleep(0.01)
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_runs_an_example_fill_job_and_writes_stats_on_sigterm(tmp_path: Path) -> None:
    ready, stats = tmp_path / "ready", tmp_path / "stats.json"
    run_dir = Path(tempfile.mkdtemp(prefix="bbcli-", dir="/tmp"))  # pytest's tmp_path is too long for socket paths
    try:
        _run_an_example_fill_job(run_dir, ready, stats)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_an_example_fill_job(run_dir: Path, ready: Path, stats: Path) -> None:
    with ready_agent("--run-dir", str(run_dir), "--training", "demo", "--executors", "2",
                     "--fill-job", str(ROOT / "examples/fill-jobs/batch-inference.yaml"), "--stats", str(stats),
                     "--log-level", "WARNING", ready=ready) as proc:
        deadline = time.monotonic() + 20
        key = GpuKey(LOCAL_NAMESPACE, "demo", 1, 0)
        stage_dir = paths.gpu_dir(run_dir, key)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        cycle = {"training": "demo", "stage": 1, "stages": 2, "microbatches": 4, "schedule": "TrainSchedule",
                 "iteration_s": 0.05, "samples": 5,
                 "slots": [{"slot": 0, "position": 3, "instruction": "RecvActivation", "kind": "fill",
                            "duration_s": 0.008, "p10_s": 0.008, "p90_s": 0.008, "free_bytes": 2**30}]}
        sock.sendto(wire.encode_profile(1, cycle), str(stage_dir / "agent.sock"))
        fill = paths.fill_socket(run_dir, key, "batch-inference")
        while not fill.exists():  # the fill process imports torch, creates and initializes the model
            assert proc.poll() is None and time.monotonic() < deadline + 20, "fill job never armed"
            time.sleep(0.02)
        sent_s = 0.0  # the bubbles' lengths as sent (the test's sleeps overshoot on a loaded machine)
        for seq in range(1, 21):
            start = time.monotonic_ns()
            for p in (stage_dir / "agent.sock", fill):
                sock.sendto(wire.encode_bubble_start(1, 0, seq, start, start + 8_000_000), str(p))
            time.sleep(0.008)
            end = time.monotonic_ns()
            for p in (stage_dir / "agent.sock", fill):
                sock.sendto(wire.encode_bubble_end(1, 0, seq, end), str(p))
            sent_s += (end - start) / 1e9
            time.sleep(0.004)
        time.sleep(0.2)
    data = json.loads(stats.read_text())
    assert data["training"] == "demo" and data["budget"] == 0.01
    assert set(data["modes"]) == {"off", "naive", "harvest"}
    h = data["modes"]["harvest"]
    assert h["fill_steps"] > 0 and h["fill_flops"] > 0 and h["bubble_s"] == pytest.approx(sent_s, rel=0.1)
    job = data["jobs"][0]
    assert job["name"] == "batch-inference" and job["stage"] == 1 and job["state"] == "STOPPED"
    assert job["steps"] == h["fill_steps"] and job["flops"] > 0
    assert {"stage", "job", "start_ns", "end_ns", "flops", "mode", "signal_ns"} <= set(data["steps"][0])
    assert {"stage", "slot", "start_ns", "end_ns", "mode"} <= set(data["bubbles"][0])
    assert set(data["guard"]) >= {"share", "baseline_s", "slowdown_held", "history"}
    assert not list(run_dir.rglob("*.sock")), "sockets left behind"
    assert os.path.exists(ready)


# -- devices and isolation flags ---------------------------------------------------------------------
FAKES = Path(__file__).parent / "fakes"


def _agent_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``bubbles agent ARGS`` in this process (the same code path, without a process start per bad flag)."""
    from bubbles.cli import main

    try:
        code = main(["agent", *args])
    except SystemExit as exc:  # argparse rejects a flag it parses itself (an unknown choice)
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--isolation", "sometimes"], "argument --isolation: invalid choice: 'sometimes'"),
        (["--mps-thread-percentage", "0"], "--mps-thread-percentage must be 1..100"),
        (["--mps-thread-percentage", "101"], "--mps-thread-percentage must be 1..100"),
        (["--mps-check-interval", "0"], "--mps-check-interval must be > 0 seconds"),
        (["--mps-daemon", "theirs"], "argument --mps-daemon: invalid choice: 'theirs'"),
        (["--cuda-context-mib", "lots"], "argument --cuda-context-mib: invalid int value: 'lots'"),
        (["--cuda-context-mib", "20000"], "--cuda-context-mib must be whole MiB from 0 to 16384"),
        (["--mps-control", "/no/such/nvidia-cuda-mps-control"],
         "--mps-control /no/such/nvidia-cuda-mps-control does not exist"),
        (["--devices", "gpu"], "--devices entry 'gpu' is neither cpu nor cuda:N with N a GPU index (write cuda:0"),
        (["--devices", "cuda:0,,cpu"], "--devices must be a comma-separated list of cpu or cuda:N entries"),
        (["--devices", "cuda:x"], "--devices entry 'cuda:x' is neither cpu nor cuda:N"),
    ],
)
def test_cli_bad_device_and_isolation_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   args: list[str], needle: str) -> None:
    code, err = _agent_in_process(capsys, "--run-dir", str(tmp_path), *args)
    assert code == 2 and needle in err, err


def test_cli_bad_mps_paths_and_a_gpu_job_without_memory_exit_2(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    not_executable = tmp_path / "nvidia-cuda-mps-control"
    not_executable.write_text("#!/bin/sh\n")
    code, err = _agent_in_process(capsys, "--run-dir", str(tmp_path), "--isolation", "mps",
                                  "--mps-control", str(not_executable))
    assert code == 2 and "is not executable; chmod +x it" in err, err
    a_file = tmp_path / "file"
    a_file.write_text("")
    code, err = _agent_in_process(capsys, "--run-dir", str(tmp_path), "--mps-pipe-dir", str(a_file))
    assert code == 2 and f"--mps-pipe-dir {a_file} is a file, not a directory" in err, err
    code, err = _agent_in_process(capsys, "--run-dir", str(tmp_path), "--isolation", "mps", "--mps-control",
                                  str(FAKES / "nvidia-cuda-mps-control"), "--mps-pipe-dir", str(tmp_path / ("p" * 110)),
                                  "--mps-log-dir", str(tmp_path / "l"))
    assert code == 2 and "choose a shorter --mps-pipe-dir" in err, err
    spec = tmp_path / "job.yaml"
    spec.write_text("name: greedy\nentry: a:B\n")
    code, err = _agent_in_process(capsys, "--run-dir", str(tmp_path), "--devices", "cuda:0", "--isolation", "none",
                                  "--fill-job", str(spec))
    assert code == 2 and "'greedy' would run on cuda:0 but declares no memory limit" in err
    assert "memory: 2Gi" in err


@pytest.mark.parametrize("mode", ["none", "mps"])
def test_cli_reports_the_isolation_in_its_stats(tmp_path: Path, mode: str) -> None:
    """``--isolation none --allow-unisolated`` is fine; ``mps`` starts the (stand-in) daemon and quits it."""
    run_dir, ready, stats = tmp_path / "run", tmp_path / "ready", tmp_path / "stats.json"
    pipe, logs = tmp_path / "p", tmp_path / "l"
    extra = (["--allow-unisolated"] if mode == "none" else
             ["--mps-control", str(FAKES / "nvidia-cuda-mps-control"), "--mps-pipe-dir", str(pipe),
              "--mps-log-dir", str(logs)])
    with ready_agent("--run-dir", str(run_dir), "--isolation", mode, *extra, "--stats", str(stats),
                     "--log-level", "WARNING", ready=ready):
        pass
    iso = json.loads(stats.read_text())["isolation"]
    if mode == "none":
        assert iso["mode"] == "none" and iso["state"] == "unisolated" and iso["daemon"] is None
        return
    assert iso["mode"] == "mps" and iso["state"] == "ready" and iso["daemon"]["owned"]
    assert (pipe / "commands.log").read_text().splitlines()[-1] == "quit"
    assert not (pipe / "control").exists()


def test_a_run_dir_too_deep_for_unix_sockets_is_refused_with_what_to_do(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    r = _agent("--run-dir", str(deep), "--training", "t")
    assert r.returncode == 2, r.stderr
    assert "longer than the 107 a Unix socket allows: use a shorter run directory (--run-dir" in r.stderr, r.stderr


# -- --exit-when-done: the agent's own end --------------------------------------------------------------------------
HOOK = r"""
import os, sys, time
from bubbles.core import card, paths
run_dir, training, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
key = paths.GpuKey(paths.LOCAL_NAMESPACE, training, stage, 0)
path = paths.hook_card(run_dir, key)
paths.make_private_dir(path.parent)
fd = card.hold_lock(paths.hook_lock(run_dir, key))  # as the hook: the lock before the card
card.write_card(path, card.Card(training=training, stage=stage, stages=2, namespace=key.namespace, pod="test",
                                device="cpu", gpu_uuid=None, pid=os.getpid(), started_ns=time.time_ns(),
                                lock=fd is not None))
print("attached", flush=True)
if sys.stdin.readline().strip() == "detach":  # as detach(): the card removed, the lock let go; the process lives on
    path.unlink()
    card.release_lock(fd)
    print("detached", flush=True)
time.sleep(600)
"""


def test_exit_when_done_ends_the_agent_once_every_hook_detached_or_died(tmp_path: Path) -> None:
    """The shell's watch on real cards, locks and processes: a stage whose hook detached (its process lives on) and
    one whose process was SIGKILLed (its card left behind, its lock free). The agent exits 0 by itself, stats and
    summary written; a card left by an earlier run was no start."""
    run_dir = Path(tempfile.mkdtemp(prefix="bbexit-", dir="/tmp"))
    stale = paths.hook_card(run_dir, GpuKey(LOCAL_NAMESPACE, "t", 1, 0))
    stale.parent.mkdir(parents=True)
    (stale.parent / paths.HOOK_LOCK_NAME).write_text("")
    stale.write_text(json.dumps({"training": "t", "stage": 1, "stages": 2, "pod": "old", "lock": True, "version": 4,
                                 "namespace": LOCAL_NAMESPACE, "rank": 0, "ranks": 1}))
    ready, stats = tmp_path / "ready", tmp_path / "stats.json"
    agent = subprocess.Popen([sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training",
                              "t", "--executors", "2", "--exit-when-done", "--stats", str(stats), "--ready-file",
                              str(ready), "--log-level", "WARNING"], stderr=subprocess.PIPE, text=True)
    hooks = []
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert agent.poll() is None and time.monotonic() < deadline, "agent did not get ready"
            time.sleep(0.01)
        time.sleep(1.5)  # the watch sees the earlier run's card: no start, so no end
        assert agent.poll() is None, "the agent took an earlier run's card for its training's end"
        for stage in (0, 1):
            hooks.append(subprocess.Popen([sys.executable, "-c", HOOK, str(run_dir), "t", str(stage)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert hooks[-1].stdout is not None and hooks[-1].stdout.readline() == "attached\n"
        time.sleep(1.0)  # seen live
        assert agent.poll() is None
        assert hooks[0].stdin is not None and hooks[0].stdout is not None
        hooks[0].stdin.write("detach\n")
        hooks[0].stdin.flush()
        assert hooks[0].stdout.readline() == "detached\n"
        time.sleep(4.0)  # stage 0 gone longer than ENDED_AFTER_S, stage 1 alive: no end
        assert agent.poll() is None, "the agent ended while stage 1's hook still ran"
        gone = time.monotonic()
        hooks[1].kill()
        hooks[1].wait(10)
        code = agent.wait(30)
        took = time.monotonic() - gone
        err = agent.stderr.read() if agent.stderr else ""
    finally:
        for h in hooks:
            h.kill()
            h.wait(10)
        if agent.poll() is None:
            agent.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert code == 0, err
    assert took < 10, f"the agent took {took:.1f} s to see its training end"
    assert "training 't' ended: every GPU's hook is gone (stage 0 rank 0: its hook detached (its card was removed); " \
           "stage 1 rank 0: its process is gone (its card is left, but nothing holds the card's lock))" in err
    assert "  stage 0 (cpu:0): no bubbles signalled in harvest mode" in err and f"stats: {stats}" in err
    assert json.loads(stats.read_text())["ended"]["code"] == 0


def test_exit_when_done_gives_up_on_a_training_that_never_starts_with_a_start_timeout(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    r = _agent("--run-dir", str(tmp_path / "run"), "--training", "nobody", "--exit-when-done", "--start-timeout",
               "0.5", "--stats", str(stats), "--log-level", "WARNING")
    assert r.returncode == 1, r.stderr
    assert "bubbles agent: no stage of training 'nobody' started within 0.5 s (--start-timeout)" in r.stderr
    ended = json.loads(stats.read_text())["ended"]
    assert ended["code"] == 1 and "--run-dir, --training" in ended["reason"]
