"""A real Kubernetes API server for the tests: etcd and kube-apiserver 1.20 on loopback, RBAC on.

The binaries come from ``tools/kube-from-debian.sh`` (``$KUBEBUILDER_ASSETS`` first, then its cache; it builds
them from Debian's packages once, which ``make test`` does before pytest). Where they cannot be had, the tests
that need them are skipped with a message saying so and how to get them.

Users authenticate with static tokens: ``admin`` (system:masters) and one for the operator's ServiceAccount
identity, so RBAC decides what the operator may do exactly as it would in a cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubbles.demo.orchestrate.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "kube-from-debian.sh"
ADMIN_TOKEN = "bubbles-test-admin-token"
OPERATOR_TOKEN = "bubbles-test-operator-token"
OPERATOR_NAMESPACE = "bubbles-system"
OPERATOR_SA = "bubbles-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"


def _have(d: Path) -> bool:
    return all(os.access(d / b, os.X_OK) for b in ("kube-apiserver", "etcd", "kubectl"))


def find_assets() -> tuple[Path | None, str]:
    """The directory with kube-apiserver, etcd and kubectl, or None and why not (without building)."""
    env = os.environ.get("KUBEBUILDER_ASSETS")
    if env and _have(Path(env)):
        return Path(env), ""
    cache = Path(os.environ.get("BUBBLES_KUBE_CACHE", Path.home() / ".cache/bubbles/kube-1.20.2"))
    if _have(cache):
        return cache, ""
    return None, (f"no kube-apiserver/etcd/kubectl in $KUBEBUILDER_ASSETS or {cache}: run {SCRIPT.relative_to(ROOT)} "
                  "once (builds them from Debian's packages, about 10 minutes; `make test` does it)")


@dataclass
class ApiServer:
    url: str
    workdir: Path
    assets: Path
    admin_kubeconfig: Path
    operator_kubeconfig: Path

    @property
    def ca_path(self) -> str:
        """The API server's self-signed serving certificate (for clients that verify TLS, as the operator does)."""
        return str(self.workdir / "certs" / "apiserver.crt")

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this server (as admin unless ``kubeconfig`` says otherwise)."""
        cmd = [str(self.assets / "kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, input=input_text)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
        return proc

    def request(self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN,
                content_type: str = "application/json") -> tuple[int, Any]:
        """One HTTP call to the API server; (status, decoded JSON body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, _decode(err.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")  # /readyz and friends answer in plain text


def _kubeconfig(path: Path, url: str, token: str, user: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": "default"}}],
    }))
    return path


@contextlib.contextmanager
def api_server(workdir: Path, assets: Path, timeout_s: float = 60.0) -> Iterator[ApiServer]:
    """Start etcd and kube-apiserver in ``workdir``; stop both (and remove their state) on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    etcd_port, peer_port, api_port = free_ports(3)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    key = workdir / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(workdir / "sa.pub")], check=True,
                   capture_output=True)
    # A client CA and one client certificate (an admin, as kubeadm writes them), for kubeconfigs that use one.
    pki = workdir / "pki"
    pki.mkdir(exist_ok=True)
    for cmd in (["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "ca.key"),
                 "-out", str(pki / "ca.crt"), "-days", "2", "-subj", "/CN=bubbles-test-ca"],
                ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "client.key"),
                 "-out", str(pki / "client.csr"), "-subj", "/O=system:masters/CN=bubbles-cert-admin"],
                ["openssl", "x509", "-req", "-in", str(pki / "client.csr"), "-CA", str(pki / "ca.crt"), "-CAkey",
                 str(pki / "ca.key"), "-CAcreateserial", "-out", str(pki / "client.crt"), "-days", "2"]):
        subprocess.run(cmd, check=True, capture_output=True)
    tokens = workdir / "tokens.csv"
    tokens.write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n'
                      f'{OPERATOR_TOKEN},{OPERATOR_USER},operator-uid,'
                      f'"system:serviceaccounts,system:serviceaccounts:{OPERATOR_NAMESPACE}"\n')
    procs: list[subprocess.Popen[bytes]] = []
    try:
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        procs.append(subprocess.Popen(
            [str(assets / "etcd"), "--data-dir", str(workdir / "etcd"), "--listen-client-urls", etcd_url,
             "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--unsafe-no-fsync"],
            stdout=(logs / "etcd.log").open("wb"), stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(
            [str(assets / "kube-apiserver"), "--etcd-servers", etcd_url, "--bind-address", "127.0.0.1",
             "--advertise-address", "127.0.0.1", "--secure-port", str(api_port), "--cert-dir", str(workdir / "certs"),
             "--token-auth-file", str(tokens), "--client-ca-file", str(pki / "ca.crt"), "--authorization-mode", "RBAC",
             "--service-account-issuer", "https://kubernetes.default.svc", "--service-account-key-file",
             str(workdir / "sa.pub"), "--service-account-signing-key-file", str(key),
             "--service-cluster-ip-range", "10.0.0.0/24", "--allow-privileged=true", "--event-ttl", "1h"],
            stdout=(logs / "kube-apiserver.log").open("wb"), stderr=subprocess.STDOUT))
        url = f"https://127.0.0.1:{api_port}"
        server = ApiServer(url, workdir, assets, _kubeconfig(workdir / "admin.kubeconfig", url, ADMIN_TOKEN, "admin"),
                           _kubeconfig(workdir / "operator.kubeconfig", url, OPERATOR_TOKEN, "operator"))
        deadline = time.monotonic() + timeout_s
        while True:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {logs}")
            with contextlib.suppress(OSError):
                status, _ = server.request("GET", "/readyz")
                if status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready after {timeout_s} s; see {logs}")
            time.sleep(0.2)
        yield server
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        shutil.rmtree(workdir / "etcd", ignore_errors=True)
