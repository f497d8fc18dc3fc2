"""The fill process (``python -m bubbles.sdk``) in-process: loading the entry, its settings from the environment,
attaching to the agent, and what the agent is told when the job fails."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from bubbles.core import control, paths
from bubbles.training.sdk import runtime as runtime_module
from bubbles.training.sdk.attach import attach_to_agent
from bubbles.training.sdk.device import DeviceSync
from bubbles.training.sdk.env import spin_window_ns
from bubbles.training.sdk.jobs import IterativeFillJob, load_entry
from bubbles.training.sdk.process import run_fill_process


def test_load_entry_rejects_what_is_not_a_fill_job() -> None:
    with pytest.raises(ValueError, match="must look like"):
        load_entry("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_entry("no.such.module:Job")
    with pytest.raises(ValueError, match="not a subclass"):
        load_entry("json:JSONDecoder")
    assert load_entry("bubbles.fill_examples.image_classification:ImageClassification").__name__ == \
        "ImageClassification"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({control.DEVICE_ENV: "gpu"}, "device 'gpu' is neither"),
        ({control.MEMORY_ENV: "2Gi"}, "$BUBBLES_MEMORY_BYTES='2Gi' is not an integer number of bytes >= 0"),
        ({control.MEMORY_ENV: "-5"}, "$BUBBLES_MEMORY_BYTES='-5'"),
        ({control.FILL_WAIT_ENV: "poll"}, "$BUBBLES_FILL_WAIT='poll': give 'block'"),
    ],
)
def test_the_fill_process_refuses_a_bad_device_memory_limit_or_wait(env: dict[str, str], needle: str,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_fill_process(["--entry", "helpers.sdk:BusyJob"]) == 2
    assert needle in capsys.readouterr().err


class BrokenAtCreate(IterativeFillJob):
    def create(self) -> None:
        open("/no/such/dataset.bin", "rb")  # noqa: SIM115

    def step(self) -> None:
        raise AssertionError("never reached")


def test_a_failing_job_tells_the_agent_what_failed_and_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent logs the message and the operator puts it in the FillJob's Events: by the time someone reads it, the
    fill Pod and its log may be gone, so the message says where the error was raised."""
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "broken")
    with pytest.raises(FileNotFoundError):
        run_fill_process(["--entry", "test_sdk_process:BrokenAtCreate"])
    ours.settimeout(5)
    events = [json.loads(line) for line in ours.recv(65536).decode().splitlines() if line]
    (err,) = [e for e in events if e.get("type") == "error"]
    assert err["message"].startswith("FileNotFoundError: [Errno 2] No such file or directory: '/no/such/dataset.bin'")
    assert f"(at {__file__}:" in err["message"]
    assert "in create)" in err["message"]
    ours.close()


def test_attaching_reads_the_welcome_only_and_leaves_the_agents_next_commands_on_the_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent may send its first command (init) right behind the welcome, in the same segment: the SDK must not
    swallow it with the welcome (the cluster tier saw fill Pods fail with 'reply line is not JSON (Extra data)')."""
    monkeypatch.setenv(paths.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(control.UID_ENV, "uid-1")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    paths.make_private_dir(paths.attach_dir(tmp_path))
    server.bind(str(paths.attach_socket(tmp_path)))
    server.listen(1)

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)  # the hello
            conn.sendall(control.encode("welcome", job="j-a0", socket=str(tmp_path / "f.sock"), stage=0)
                         + control.encode("init"))
            conn.recv(1)  # until the client closes

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    sock, welcome = attach_to_agent("cpu", timeout_s=10)
    assert welcome.type == "welcome"
    assert welcome["job"] == "j-a0"
    sock.settimeout(10)
    assert control.parse_command(sock.recv(4096)).type == "init"  # still there for the control channel
    sock.close()
    t.join(10)
    server.close()


@pytest.mark.parametrize(("agent_says", "refused"), [({"protocol": control.VERSION}, False), ({}, False),
                                                     ({"protocol": control.MIN_VERSION - 1}, True)])
def test_the_sdk_checks_the_agents_control_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    agent_says: dict[str, int], refused: bool) -> None:
    """The hello says the SDK's version; a welcome from an agent older than the SDK can work with is refused, naming
    both versions (an agent that says none predates the field and speaks v2)."""
    monkeypatch.setenv(paths.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(control.UID_ENV, "uid-1")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    paths.make_private_dir(paths.attach_dir(tmp_path))
    server.bind(str(paths.attach_socket(tmp_path)))
    server.listen(1)
    heard: list[control.ControlMessage] = []

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            heard.append(control.parse_hello(conn.makefile("rb").readline()))
            conn.sendall(control.encode("welcome", job="j-a0", socket=str(tmp_path / "f.sock"), stage=0, **agent_says))
            conn.recv(1)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    try:
        if refused:
            with pytest.raises(ValueError, match=f"speaks control v{control.MIN_VERSION - 1}; this side needs "
                                                 f"v{control.MIN_VERSION}: upgrade the chart"):
                attach_to_agent("cpu", timeout_s=10)
        else:
            sock, welcome = attach_to_agent("cpu", timeout_s=10)
            assert welcome.type == "welcome"
            sock.close()
    finally:
        t.join(10)
        server.close()
    assert control.peer_version(heard[0]) == control.VERSION


@pytest.mark.parametrize(("text", "ns"), [("", 0), ("0", 0), ("150", 150_000), (" 2.5 ", 2_500)])
def test_the_spin_window_comes_from_the_environment_in_microseconds(text: str, ns: int) -> None:
    assert spin_window_ns(text) == ns


@pytest.mark.parametrize("text", ["fast", "-1", "20000", "nan"])
def test_a_bad_spin_window_says_what_to_give(text: str) -> None:
    with pytest.raises(ValueError, match="give microseconds from 0"):
        spin_window_ns(text)


class CudaAtCreate(IterativeFillJob):
    """A job whose create() makes a context on device 0, as a .cuda() there would (torch told so by the test)."""

    def create(self) -> None:
        import torch

        torch.cuda.is_initialized = lambda: True  # type: ignore[method-assign]
        torch._C._cuda_hasPrimaryContext = lambda index: index == 0  # type: ignore[attr-defined]

    def init(self) -> None:
        raise AssertionError("never reached: the job is refused before the agent's init")

    def step(self) -> None:
        raise AssertionError("never reached")


def test_a_job_whose_create_made_a_cuda_context_tells_the_agent_and_never_reports_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # What the job patches, restored after the test; before create() CUDA is initialised (attaching queried the
    # device, say) but no context exists.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: False, raising=False)
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "cuda-at-create")
    monkeypatch.setenv(control.DEVICE_ENV, "cuda:1")
    with pytest.raises(RuntimeError, match="into init"):
        run_fill_process(["--entry", "test_sdk_process:CudaAtCreate"])
    ours.settimeout(5)
    events = [json.loads(line) for line in ours.recv(65536).decode().splitlines() if line]
    assert [e["type"] for e in events] == ["error"], events  # never CREATED: the agent does not init it
    assert "create() made a CUDA context (on device 0) before the agent gave this job its device (cuda:1)" in \
        events[0]["message"]
    ours.close()


@pytest.mark.parametrize(("env", "wait"), [(None, "block"), ("spin", "spin")])
def test_the_fill_process_waits_for_its_steps_as_bubbles_fill_wait_says(env: str | None, wait: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, str]] = []

    def device_sync(device: str, cuda: Any = None, wait: str = "") -> DeviceSync:
        made.append((device, wait))
        return DeviceSync()

    monkeypatch.setattr(runtime_module, "device_sync_for", device_sync)
    monkeypatch.setattr(runtime_module, "apply_process_limits", lambda device, memory: None)  # no GPU to cap here
    if env is None:
        monkeypatch.delenv(control.FILL_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(control.FILL_WAIT_ENV, env)
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "waits")
    monkeypatch.setenv(control.DEVICE_ENV, "cuda:1")
    ours.sendall(control.encode("init") + control.encode("stop"))
    assert run_fill_process(["--entry", "helpers.sdk:Counter"]) == 0
    assert made == [("cuda:1", wait)]
    ours.close()
