"""How `bubbles operator` finds its API server: kubeconfig files as kind, minikube and kubeadm write them."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bubbles.operator.kube import TOKEN_CHECK_S, Connection, TokenFile


def kubeconfig(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], namespace: str = "ml") -> Path:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": namespace}}]}))
    return path


def test_inline_certificates_and_relative_files(tmp_path: Path) -> None:
    ca = base64.b64encode(b"CA PEM").decode()
    (tmp_path / "client.crt").write_text("CERT PEM")
    cfg = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443", "certificate-authority-data": ca},
                     {"client-certificate": "client.crt", "client-key-data": base64.b64encode(b"KEY").decode()})
    c = Connection.from_environment(cfg)
    assert c.server == "https://127.0.0.1:6443" and c.namespace == "ml" and c.token is None
    assert c.ca_path and Path(c.ca_path).read_bytes() == b"CA PEM" and oct(Path(c.ca_path).stat().st_mode)[-3:] == "600"
    assert c.cert_path == str(tmp_path / "client.crt") and c.key_path and Path(c.key_path).read_bytes() == b"KEY"
    client = c.api_client()
    assert client.configuration.cert_file == c.cert_path and client.configuration.ssl_ca_cert == c.ca_path


def test_a_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    c = Connection.from_environment(kubeconfig(tmp_path, {"server": "https://k:6443", "insecure-skip-tls-verify": True},
                                               {"tokenFile": "token"}))
    assert c.token == "s3cret" and c.insecure and c.ca_path is None


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot read kubeconfig"),
        ("clusters: [\n", "not valid YAML"),
        ("- 1\n", "is not a kubeconfig"),
        ("current-context: nowhere\ncontexts: []\n", "has no current context"),
    ],
)
def test_bad_kubeconfigs_say_what_to_do(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "config"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        Connection.from_environment(path)


def test_plugins_and_bad_inline_data_are_refused(tmp_path: Path) -> None:
    cfg = kubeconfig(tmp_path, {"server": "https://k"}, {"exec": {"command": "aws"}})
    with pytest.raises(ValueError, match="authenticates through a plugin"):
        Connection.from_environment(cfg)
    cfg = kubeconfig(tmp_path, {"server": "https://k", "certificate-authority-data": "not base64!"}, {})
    with pytest.raises(ValueError, match="certificate-authority-data is not base64"):
        Connection.from_environment(cfg)
    cfg = kubeconfig(tmp_path, {"certificate-authority": "x"}, {})
    with pytest.raises(ValueError, match="has no server"):
        Connection.from_environment(cfg)


@pytest.mark.kube
def test_a_client_certificate_kubeconfig_reaches_a_real_api_server(tmp_path: Path, kube: Any) -> None:
    import kubernetes

    pki = kube.workdir / "pki"
    data = {name: base64.b64encode((pki / f"client.{ext}").read_bytes()).decode()
            for name, ext in (("client-certificate-data", "crt"), ("client-key-data", "key"))}
    cfg = kubeconfig(tmp_path, {"server": kube.url, "certificate-authority": kube.ca_path}, data)
    c = Connection.from_environment(cfg)
    namespaces = kubernetes.client.CoreV1Api(c.api_client()).list_namespace()
    assert any(ns.metadata.name == "default" for ns in namespaces.items)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--interval", "0"], "--interval must be > 0 seconds"),
        (["--full-pass-interval", "0"], "--full-pass-interval must be > 0 seconds"),
        (["--metrics-port", "70000"], "--metrics-port must be a TCP port"),
        (["--policy", "luck"], "unknown scheduling policy 'luck'; known policies:"),
        (["--kubeconfig", "/no/such/kubeconfig"], "cannot read kubeconfig /no/such/kubeconfig"),
        (["--agent-port", "0"], "--agent-port must be a TCP port"),
        (["--fill-pod-tolerations", "nvidia.com/gpu"], "--fill-pod-tolerations must be a JSON list of tolerations"),
        (["--fill-pod-tolerations", '{"key": "a"}'], "--fill-pod-tolerations must be a JSON list of tolerations"),
        (["--fill-pod-tolerations", '[{"key": "a", "operator": "Maybe"}]'], "operator must be Exists or Equal"),
        (["--fill-runtime-class", "Nvidia"], "--fill-runtime-class: the fill Pods' RuntimeClass 'Nvidia' is not a "
                                             "RuntimeClass name"),
        (["--agent-timeout", "-1"], "--agent-timeout must be > 0 seconds"),
        (["--fill-cuda-context-mib", "-1"], "--fill-cuda-context-mib must be whole MiB from 0 to 16384"),
        (["--fill-pod-start-timeout", "0"], "--fill-pod-start-timeout must be > 0 and at most 86400 seconds"),
        (["--fill-pod-start-timeout", "1e6"], "--fill-pod-start-timeout must be > 0 and at most 86400 seconds"),
        (["--agent-down-after", "-1"], "--agent-down-after must be >= 0 seconds"),
        (["--agent-selector", "app"], "--agent-selector: 'app' is not key=value"),
        (["--agent-token-file", "/tmp/t"], "need --agent-ca"),
        (["--agent-ca", "/no/such/ca.crt", "--agent-token-file", "/no/t"], "cannot read the agent TLS files"),
        (["--agent-ca", "/no/such/ca.crt"], "a client certificate (--agent-client-cert/-key) or a token"),
        (["--agent-ca", "/no/ca", "--agent-client-cert", "/no/c"], "go together"),
        (["--node-run-dir", "run/bubbles"], "the node's run directory must be an absolute path"),
        (["--fill-uid", "-3"], "fill Pods' user id must be >= 0, got -3"),
        (["--fill-mps-pipe-dir", "nvidia-mps"], "the MPS pipe directory must be an absolute path"),
        (["--fill-mps-pipe-dir", "/tmp/m", "--fill-mps-thread-percentage", "0"], "from 1 to 100, got 0"),
        (["--fill-mps-thread-percentage", "50"], "--fill-mps-thread-percentage needs --fill-mps-pipe-dir"),
        (["--fill-mps-shm-dir", "/run/s"], "--fill-mps-shm-dir needs --fill-mps-pipe-dir"),
        (["--fill-mps-pipe-dir", "/tmp/m", "--fill-mps-shm-dir", "/tmp/m"], "apart from the MPS pipe directory"),
    ],
)
def test_bad_operator_flags_exit_2_with_the_fix(flags: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from bubbles.cli import main

    assert main(["operator", "--no-leader-election", *flags]) == 2
    assert needle in capsys.readouterr().err


def rotate(path: Path, token: str) -> None:
    """Replace the token file in one rename, as the kubelet swaps a projected token's directory."""
    new = path.with_name(path.name + ".new")
    new.write_text(token + "\n")
    new.replace(path)


def test_a_token_file_is_read_again_as_it_rotates_and_no_more_than_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    now = [0.0]
    tokens = TokenFile(str(path), clock=lambda: now[0])
    assert tokens.token() == "first"
    rotate(path, "second")
    assert tokens.token() == "first"  # looked at again only after TOKEN_CHECK_S
    now[0] += TOKEN_CHECK_S
    assert tokens.token() == "second"
    now[0] += TOKEN_CHECK_S
    assert tokens.token() == "second"
    assert tokens.reads == 2  # an unchanged file is not read again


def test_a_token_file_that_goes_missing_or_empty_keeps_the_last_token_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    now = [0.0]
    tokens = TokenFile(str(path), clock=lambda: now[0])
    assert tokens.token() == "first"
    path.unlink()
    now[0] += TOKEN_CHECK_S
    assert tokens.token() == "first"
    path.write_text("")
    now[0] += TOKEN_CHECK_S
    assert tokens.token() == "first"
    said = [r.getMessage() for r in caplog.records if "cannot read the API token" in r.getMessage()]
    assert len(said) == 1  # once, not at every request
    with pytest.raises(OSError):
        TokenFile(str(tmp_path / "never")).token()  # no token ever: the caller is told


def test_the_client_and_kopf_use_the_files_latest_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    c = Connection.from_environment(kubeconfig(tmp_path, {"server": "https://k:6443"}, {"tokenFile": "token"}))
    assert c.token_file == str(path)
    conf = c.api_client().configuration
    assert conf.get_api_key_with_prefix("authorization") == "Bearer first"
    rotate(path, "second")
    time.sleep(TOKEN_CHECK_S)
    assert conf.get_api_key_with_prefix("authorization") == "Bearer second"  # the client asks before each request
    assert c.current_token() == "second"  # what kopf's login hands it
    assert Connection("https://k", token="fixed").current_token() == "fixed"  # a token given as it is stays


def test_in_a_pod_the_serviceaccount_token_is_followed_as_the_kubelet_rotates_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("projected-1\n")
    (sa / "namespace").write_text("bubbles-system\n")
    (sa / "ca.crt").write_text("CA")
    monkeypatch.setattr("bubbles.operator.kube.SERVICEACCOUNT_DIR", sa)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    c = Connection.from_environment()
    assert c.token_file == str(sa / "token")
    assert c.token == "projected-1"
    rotate(sa / "token", "projected-2")
    time.sleep(TOKEN_CHECK_S)
    assert c.current_token() == "projected-2"
