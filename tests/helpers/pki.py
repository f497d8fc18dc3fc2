"""Test certificates with the openssl command line: a CA, a server certificate for the agents, client certificates.

EC P-256 keys (fast to make). The server certificate names ``bubbles-agent`` (as the chart issues it: one name for
every node's agent); client certificates carry clientAuth.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "bubbles-agent"


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> Issued:
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "2", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return Issued(cert, key)


def issue(ca: Issued, d: Path, name: str, *, server: bool) -> Issued:
    cert, key, csr, ext = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
         "-out", str(csr), "-subj", f"/CN={name}")
    usage = f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth\n" if server else "extendedKeyUsage=clientAuth\n"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n" + usage)
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial", "-out",
         str(cert), "-days", "2", "-extfile", str(ext))
    return Issued(cert, key)


@dataclass(frozen=True)
class Pki:
    ca: Issued
    server: Issued
    client: Issued  # the operator's, signed by ca
    stranger: Issued  # a client certificate from another CA
    token: Path  # a bearer token file

    @classmethod
    def make(cls, d: Path) -> Pki:
        ca = make_ca(d, "ca")
        other = make_ca(d, "other-ca")
        token = d / "token"
        token.write_text("s3cret-token-of-enough-length\n")
        return cls(ca, issue(ca, d, SERVER_NAME, server=True), issue(ca, d, "bubbles-operator", server=False),
                   issue(other, d, "stranger", server=False), token)
