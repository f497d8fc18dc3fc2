"""``bubbles agent --cluster --csi`` (issue 36, step 1): off by default, its paths checked before anything starts, and
when on, the CSI node plugin served and registered beside the operator's gRPC service, its sockets removed at SIGTERM.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tests.helpers.pki import Pki

from bubbles.agent.config import ConfigError, CsiSettings, load_settings
from bubbles.agent.csi import DEFAULT_KUBELET_DIR, csi_socket, registration_socket
from bubbles.agent.csi.pb.csi.v1 import csi_pb2 as csi
from bubbles.agent.csi.pb.csi.v1 import csi_pb2_grpc as csi_grpc
from bubbles.agent.csi.pb.pluginregistration.v1 import api_pb2 as reg
from bubbles.agent.csi.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from bubbles.demo.orchestrate.processes import free_ports


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is at most 107 bytes; pytest's tmp_path can be longer)."""
    d = Path(tempfile.mkdtemp(prefix="bcsi-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cluster(tmp_path: Path, **flags: Any) -> dict[str, Any]:
    for name in ("tls.crt", "tls.key", "token"):
        (tmp_path / name).write_text("x")
    return {"run_dir": tmp_path / "run", "cluster": True, "node": "node-a", "tls_cert": tmp_path / "tls.crt",
            "tls_key": tmp_path / "tls.key", "token_file": tmp_path / "token", **flags}


def test_the_csi_plugin_is_off_unless_asked_and_takes_the_kubelets_directory(tmp_path: Path) -> None:
    cluster = load_settings(_cluster(tmp_path), {}).cluster
    assert cluster is not None and cluster.csi is None
    cluster = load_settings(_cluster(tmp_path, csi=True, kubelet_dir=tmp_path), {}).cluster
    assert cluster is not None and cluster.csi == CsiSettings(tmp_path)
    cluster = load_settings(_cluster(tmp_path), {"BUBBLES_AGENT_CSI": "true",
                                                 "BUBBLES_AGENT_KUBELET_DIR": str(tmp_path)}).cluster
    assert cluster is not None and cluster.csi == CsiSettings(tmp_path)
    assert CsiSettings.__dataclass_fields__["kubelet_dir"].default == DEFAULT_KUBELET_DIR == Path("/var/lib/kubelet")


@pytest.mark.parametrize(("flags", "env", "needle"), [
    ({"csi": True, "kubelet_dir": Path("var/lib/kubelet")}, {},
     "--kubelet-dir must be an absolute path written plainly (the kubelet's --root-dir, default /var/lib/kubelet), "
     "got 'var/lib/kubelet'"),
    ({"csi": True}, {"BUBBLES_AGENT_KUBELET_DIR": "/var/lib/../lib/kubelet"}, "must be an absolute path"),
    ({"csi": True, "kubelet_dir": Path("/no/such/kubelet")}, {},
     "--kubelet-dir /no/such/kubelet does not exist: give the kubelet's --root-dir"),
    ({"kubelet_dir": Path("/var/lib/kubelet")}, {}, "--kubelet-dir only applies with --csi"),
    ({}, {"BUBBLES_AGENT_CSI": "sometimes"}, "--csi from $BUBBLES_AGENT_CSI: expected true or false"),
])
def test_bad_csi_paths_are_refused_with_the_fix(tmp_path: Path, flags: dict[str, Any], env: dict[str, str],
                                                needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(_cluster(tmp_path, **flags), env)
    assert needle in str(err.value)


def test_a_kubelet_dir_that_is_a_file_or_too_deep_for_a_socket_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--kubelet-dir .*/file is not a directory"):
        load_settings(_cluster(tmp_path, csi=True, kubelet_dir=tmp_path / "file"), {})
    deep = tmp_path / ("k" * 90)
    deep.mkdir()
    with pytest.raises(ConfigError, match="longer than the 107 a Unix socket allows: give a shorter --kubelet-dir"):
        load_settings(_cluster(tmp_path, csi=True, kubelet_dir=deep), {})


def test_csi_flags_without_cluster_mode_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--csi only apply with --cluster"):
        load_settings({"run_dir": tmp_path, "csi": True}, {})
    with pytest.raises(ConfigError, match="--csi, --kubelet-dir only apply with --cluster"):
        load_settings({"run_dir": tmp_path, "csi": True, "kubelet_dir": tmp_path}, {})
    assert load_settings({"run_dir": tmp_path}, {"BUBBLES_AGENT_CSI": "false"}).cluster is None


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bubbles.cli", "agent", *args], capture_output=True, text=True,
                          timeout=60)


def test_the_command_line_exits_2_saying_what_to_fix(tmp_path: Path) -> None:
    flags = _cluster(tmp_path)
    base = ["--cluster", "--node", "n", "--run-dir", str(flags["run_dir"]), "--tls-cert", str(flags["tls_cert"]),
            "--tls-key", str(flags["tls_key"]), "--token-file", str(flags["token_file"])]
    for args, needle in ((["--run-dir", str(tmp_path), "--csi"], "--csi only apply with --cluster"),
                         ([*base, "--csi", "--kubelet-dir", "kubelet"], "--kubelet-dir must be an absolute path"),
                         ([*base, "--kubelet-dir", str(tmp_path)], "--kubelet-dir only applies with --csi")):
        r = _agent(*args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)


def test_bubbles_agent_cluster_csi_serves_registers_and_cleans_up_on_sigterm(tmp_path: Path, short_dir: Path) -> None:
    pki = Pki.make(tmp_path / "pki")
    kubelet = short_dir / "kubelet"
    (kubelet / "pods").mkdir(parents=True)
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bubbles.cli", "agent", "--cluster", "--node", "node-x", "--csi", "--kubelet-dir",
         str(kubelet), "--run-dir", str(short_dir / "run"), "--listen", f"127.0.0.1:{port}", "--tls-cert",
         str(pki.server.cert), "--tls-key", str(pki.server.key), "--client-ca", str(pki.ca.cert), "--isolation",
         "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not registration_socket(kubelet).exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        with grpc.insecure_channel(f"unix://{registration_socket(kubelet)}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=10)
        assert info.endpoint == str(csi_socket(kubelet))
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            assert csi_grpc.NodeStub(channel).NodeGetInfo(csi.NodeGetInfoRequest(), timeout=10).node_id == "node-x"
        assert (short_dir / "run" / "_pods").is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not registration_socket(kubelet).exists() and not csi_socket(kubelet).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
