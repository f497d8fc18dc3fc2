"""The operator's writes to the Kubernetes API: a thin shell over the ``kubernetes`` client, nothing decided here.

Every call is one API request; ``Writes`` counts them (the scale benchmark reports writes per placement).
Status patches are JSON merge patches that also null the fields the new status dropped, so a status is
always exactly what ``bubbles.operator.decide`` computed. A create that finds its object there already
(409) and a delete that finds nothing (404) are not errors: retries are safe.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core.api import read_yaml
from bubbles.core.resources import FINALIZER, GROUP, VERSION

from .decide import Event, fill_pod_node

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # in a Pod: its token, CA, namespace
TOKEN_CHECK_S = 1.0  # a rotating token's file is looked at no more often than this
TOKEN_LIFETIME_S = 60.0  # kopf is told a file's token expires after this, so it reads it again (client-go: a minute)


class TokenFile:
    """A bearer token in a file that is replaced as it rotates (a Pod's projected ServiceAccount token, which the
    kubelet renews before it expires; a kubeconfig's ``tokenFile``): read again whenever the file changes, looked at
    no more than once a second. A file that cannot be read or is empty keeps the last token, said once."""

    def __init__(self, path: str, clock: Any = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self._checked = -float("inf")
        self._warned = False
        self.reads = 0  # how often the file was read (changes seen)

    def token(self) -> str:
        """The file's current token; OSError or ValueError only when it never held one."""
        with self._lock:
            now = self.clock()
            if now - self._checked < TOKEN_CHECK_S and self._token:
                return self._token
            self._checked = now
            try:
                st = os.stat(self.path)  # follows the kubelet's ..data link: a new token is a new file
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                if key != self._seen:
                    text = Path(self.path).read_text().strip()
                    if not text:
                        raise ValueError(f"the token file {self.path} is empty")
                    self._token, self._seen = text, key
                    self.reads += 1
                    self._warned = False
            except (OSError, ValueError) as exc:
                if not self._token:
                    raise
                if not self._warned:
                    self._warned = True
                    logging.getLogger("bubbles.operator").warning(
                        "cannot read the API token from %s (%s): the last one is used until it can", self.path, exc)
            return self._token


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate (what kopf's login and the client both use). A token from a
    file (``token_file``: in a Pod, the ServiceAccount's) is read again as it rotates; ``token`` is the one read
    first."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    insecure: bool = False
    namespace: str | None = None  # the namespace of the operator's own Pod, if known
    cert_path: str | None = None  # a client certificate (kubeconfigs of kind, minikube, kubeadm)
    key_path: str | None = None
    token_file: str | None = None  # where the token is kept as it rotates
    _tokens: TokenFile | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token_file is not None:
            source = TokenFile(self.token_file)
            object.__setattr__(self, "_tokens", source)
            if self.token is None:
                object.__setattr__(self, "token", source.token())

    def current_token(self) -> str | None:
        """The token to send now: the file's latest where there is a file, else the one given."""
        return self._tokens.token() if self._tokens is not None else self.token

    @classmethod
    def from_environment(cls, kubeconfig: Path | None = None) -> Connection:
        """In-cluster (the ServiceAccount's token and CA), else a kubeconfig file ($KUBECONFIG, ~/.kube/config).

        From a kubeconfig: the current context's server, its CA (a file or inline ``-data``), and a token or a
        client certificate and key (files or inline). Exec and auth-provider plugins are refused with the fix.
        """
        sa = SERVICEACCOUNT_DIR
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and (sa / "token").exists():
            host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            return cls(f"https://{host}:{port}", ca_path=str(sa / "ca.crt"),
                       namespace=(sa / "namespace").read_text().strip(), token_file=str(sa / "token"))
        path = kubeconfig or Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
        if kubeconfig is None and not path.exists():
            raise ValueError(f"no in-cluster ServiceAccount and no kubeconfig at {path}: pass --kubeconfig or run "
                             "the operator in a Pod")
        cfg = read_yaml(path, "kubeconfig")
        if not isinstance(cfg, dict):
            raise ValueError(f"kubeconfig {path} is not a kubeconfig (no mapping of clusters, users, contexts)")
        ctx_name = cfg.get("current-context")
        ctx = next((c.get("context") for c in cfg.get("contexts") or [] if c.get("name") == ctx_name), None)
        if not ctx:
            raise ValueError(f"kubeconfig {path} has no current context; set one with kubectl config use-context")
        cluster = next((c.get("cluster") for c in cfg.get("clusters") or [] if c.get("name") == ctx.get("cluster")),
                       None)
        if not cluster or not cluster.get("server"):
            raise ValueError(f"kubeconfig {path}: context {ctx_name!r} names cluster {ctx.get('cluster')!r}, "
                             "which has no server")
        user: dict[str, Any] = next((u.get("user") or {} for u in cfg.get("users") or []
                                     if u.get("name") == ctx.get("user")), {})
        if user.get("exec") or user.get("auth-provider"):
            raise ValueError(f"kubeconfig {path}: user {ctx.get('user')!r} authenticates through a plugin, which "
                             "the operator does not run; give it a token or a client certificate, or run the "
                             "operator in a Pod with its ServiceAccount")
        base = path.parent

        def ref(section: Mapping[str, Any], name: str) -> str | None:
            """A file named in the kubeconfig (relative to it), or its inline ``-data`` written to a file."""
            if section.get(name):
                return str((base / section[name]).resolve())
            if section.get(f"{name}-data"):
                return _inline_file(section[f"{name}-data"], name)
            return None

        token = user.get("token")
        token_file = str((base / user["tokenFile"]).resolve()) if not token and user.get("tokenFile") else None
        return cls(str(cluster["server"]), token, ref(cluster, "certificate-authority"),
                   bool(cluster.get("insecure-skip-tls-verify")), ctx.get("namespace"),
                   ref(user, "client-certificate"), ref(user, "client-key"), token_file=token_file)

    def api_client(self, pool: int = 4) -> Any:
        import kubernetes

        c = kubernetes.client.Configuration()
        c.connection_pool_maxsize = pool
        c.host = self.server
        c.verify_ssl = not self.insecure
        if self.ca_path:
            c.ssl_ca_cert = self.ca_path
        if self.token:
            c.api_key = {"authorization": self.token}
            c.api_key_prefix = {"authorization": "Bearer"}
        if self._tokens is not None:
            tokens = self._tokens
            # Asked before every request: the file's token as it rotates (a bound token expires within the hour).
            c.refresh_api_key_hook = lambda conf: conf.api_key.__setitem__(  # type: ignore[assignment]
                "authorization", tokens.token())
        if self.cert_path and self.key_path:
            c.cert_file, c.key_file = self.cert_path, self.key_path
        return kubernetes.client.ApiClient(c)


def _inline_file(data: str, name: str) -> str:
    """Write a kubeconfig's inline base64 ``*-data`` to a private file (the clients want paths); its path."""
    import base64
    import tempfile

    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError(f"kubeconfig {name}-data is not base64") from None
    fd, path = tempfile.mkstemp(prefix=f"bubbles-{name}-")
    with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
        f.write(raw)
    return path


def status_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that turns status ``before`` into ``after`` (dropped fields are set to null)."""
    patch: dict[str, Any] = dict(after)
    for k in before:
        if k not in after:
            patch[k] = None
    return {"status": patch}


def _drain(response: Any) -> None:
    """Read and release a response whose body the operator does not need. (Turning the client's typed models off
    for these calls matters: deserializing a V1Pod or V1Event costs milliseconds of the operator's one core per
    write, more than the write itself.)"""
    response.read()
    response.release_conn()


class FinalizerConflict(RuntimeError):
    """The object changed between the read and the finalizer patch (nothing written; the next round retries)."""


class PodConflict(RuntimeError):
    """A fill Pod's name is taken by a Pod of another placement (deleted; the next round places again)."""


class PodRefused(RuntimeError):
    """The API server refused to create a fill Pod (admission: a quota, a LimitRange, Pod Security; or an invalid
    spec): the message is the API server's, for the FillJob's status."""


def _api_message(exc: Exception) -> str:
    """What the API server said in a refusal: its Status message, else the exception's reason."""
    body = getattr(exc, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return str(message or getattr(exc, "reason", None) or exc)[:1000]


class KubeWriter:
    """Carries out the operator's writes; synchronous (the operator calls it from a worker thread)."""

    def __init__(self, connection: Connection, pool: int = 4, request_timeout_s: float | None = None,
                 observe: Callable[[str, float], None] | None = None) -> None:
        import kubernetes

        # Each write gives up after this (None: the client's default); with leader election it ends before the
        # leader's validity does, so a write of a deposed leader cannot land late.
        self.timeout = request_timeout_s
        self._k = kubernetes
        # The client's own type hints want its model classes; plain dicts are what it sends, so: Any.
        self.api: Any = connection.api_client(pool)
        self.custom: Any = kubernetes.client.CustomObjectsApi(self.api)
        self.core: Any = kubernetes.client.CoreV1Api(self.api)
        self.writes: Counter[str] = Counter()  # by kind; written from the operator's write threads
        self.observe = observe  # (kind, seconds) of each write as it ends, answered or not (the operator's histogram)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _write(self, kind: str) -> Iterator[None]:
        """One write of ``kind``: counted, and timed for ``observe`` (however it ends)."""
        with self._lock:
            self.writes[kind] += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.observe is not None:
                self.observe(kind, time.perf_counter() - t0)

    def take_counts(self, only: str | None = None, exclude: str | None = None) -> dict[str, int]:
        """The writes counted since the last take (of kind ``only``, or all but ``exclude``), and forget them."""
        with self._lock:
            kinds = [k for k in self.writes if (only is None or k == only) and k != exclude]
            return {k: self.writes.pop(k) for k in kinds}

    def _ok(self, exc: Exception, *codes: int) -> bool:
        return isinstance(exc, self._k.client.ApiException) and exc.status in codes

    def patch_status(self, plural: str, namespace: str, name: str, before: Mapping[str, Any],
                     after: Mapping[str, Any], kind: str = "status") -> dict[str, Any] | None:
        """The object after the patch, or None if it is gone (``kind`` labels the write in the counts)."""
        try:
            with self._write(kind):
                return dict(self.custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, plural, name, status_patch(before, after),
                    _request_timeout=self.timeout))
        except Exception as exc:
            if self._ok(exc, 404):
                return None
            raise

    def set_finalizer(self, plural: str, namespace: str, name: str, present: bool,
                      finalizers: list[str], resource_version: str | None = None) -> dict[str, Any] | None:
        """Add or remove the operator's finalizer; the object after the patch (None if gone).

        The list is written whole, so the patch carries the ``resourceVersion`` it was computed from: if another
        controller changed the finalizers meanwhile, the API server answers 409 (``FinalizerConflict``) instead of
        the patch dropping theirs; the next round computes it again from the fresh object."""
        want = [f for f in finalizers if f != FINALIZER] + ([FINALIZER] if present else [])
        meta: dict[str, Any] = {"finalizers": want}
        if resource_version:
            meta["resourceVersion"] = resource_version
        try:
            with self._write("finalizer"):
                return dict(self.custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, plural, name, {"metadata": meta}, _request_timeout=self.timeout))
        except Exception as exc:
            if self._ok(exc, 404):
                return None
            if self._ok(exc, 409):
                raise FinalizerConflict(f"{plural} {namespace}/{name} changed while its finalizers were written; "
                                        "written again next round") from None
            raise

    def create_pod(self, manifest: Mapping[str, Any]) -> bool:
        """True if created, False if this very Pod is there already (a retried placement: same FillJob uid, same
        node). A Pod of that name from another placement (a round whose status write was lost placed the attempt
        elsewhere) is deleted and ``PodConflict`` raised: the next round places the job again."""
        meta = manifest["metadata"]
        try:
            with self._write("pod"):
                _drain(self.core.create_namespaced_pod(meta["namespace"], dict(manifest),
                                                       _request_timeout=self.timeout, _preload_content=False))
            return True
        except Exception as exc:
            # Admission (403), or a spec the cluster finds invalid (400, 422): the job's to say. Not this operator's
            # own permissions (RBAC's "cannot create resource", "cannot set blockOwnerDeletion"): its error, for its
            # log and metrics.
            if self._ok(exc, 400, 403, 422) and not any(own in _api_message(exc) for own in (
                    "cannot create resource", "cannot set blockOwnerDeletion")):
                raise PodRefused(f"{exc.status} {_api_message(exc)}") from None  # type: ignore[attr-defined]
            if not self._ok(exc, 409):
                raise
        have = self.core.read_namespaced_pod(meta["name"], meta["namespace"], _request_timeout=self.timeout)
        have_uid = ((have.metadata.annotations or {}) if have.metadata else {}).get("bubbles.dev/fill-job-uid")
        have_node = have.spec.node_name if have.spec else None
        want_uid = (meta.get("annotations") or {}).get("bubbles.dev/fill-job-uid")
        # Not scheduled yet (a Pod with a claim is placed by the scheduler, on the node its affinity requires): no node.
        if have_uid == want_uid and have_node in (None, fill_pod_node(manifest["spec"])):
            return False
        self.delete_pod(meta["namespace"], meta["name"])
        raise PodConflict(f"Pod {meta['namespace']}/{meta['name']} already existed for another placement (FillJob uid "
                          f"{have_uid}, node {have_node}); deleted, the job is placed again next round")

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            with self._write("pod_delete"):
                _drain(self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=5,
                                                       _request_timeout=self.timeout, _preload_content=False))
        except Exception as exc:
            if not self._ok(exc, 404):
                raise

    def post_event(self, event: Event, now: dt.datetime, component: str = "bubbles-operator") -> None:
        stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            # A name of its own, as kubectl's and the kubelet's Events have: <object>.<hex nanoseconds>
            "metadata": {"name": f"{event.name}.{time.time_ns():x}", "namespace": event.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": event.kind, "name": event.name,
                               "namespace": event.namespace, "uid": event.uid},
            "type": event.type, "reason": event.reason, "message": event.message[:1024],
            "source": {"component": component}, "reportingComponent": component,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            with self._write("event"):
                _drain(self.core.create_namespaced_event(event.namespace, body, _request_timeout=self.timeout,
                                                         _preload_content=False))
        except Exception as exc:
            if not self._ok(exc, 404, 403):  # an Event is best effort: losing one stops nothing
                raise
