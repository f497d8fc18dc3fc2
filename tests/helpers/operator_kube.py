"""Set-ups of the tests on a real kube-apiserver: the namespace they work in, a module's cluster (the operator's
identity bound to its ClusterRole, a training and its Pod), reading FillJobs back, and waiting for a condition."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bubbles.operator.rbac import cluster_role, cluster_role_binding
from helpers.kubeapi import OPERATOR_NAMESPACE, OPERATOR_SA, ApiServer

NS = "harvest"


def until(what: str, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """``fn()``'s first true value, asked every 0.1 s; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture(kube: ApiServer) -> Iterator[ApiServer]:
    """The operator's identity bound to its ClusterRole; a namespace with a training and its Pod."""
    manifests = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        # No controller-manager here to make the default ServiceAccount: the Pods do not mount its token anyway.
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NS},
         "automountServiceAccountToken": False},
        cluster_role(), cluster_role_binding(OPERATOR_NAMESPACE, OPERATOR_SA),
        {"apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining",
         "metadata": {"name": "llama", "namespace": NS, "labels": {"team": "a"}},
         "spec": {"selector": {"matchLabels": {"app": "llama"}}}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "llama-0", "namespace": NS, "labels": {"app": "llama"}},
         "spec": {"nodeName": "node-a", "automountServiceAccountToken": False,
                  "containers": [{"name": "train", "image": "train:1"}]}},
    ]
    kube.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))
    yield kube


def get(kube: ApiServer, kind: str, name: str) -> dict[str, Any] | None:
    """The object ``kind``/``name`` of NS, None if there is none."""
    proc = kube.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def phase(kube: ApiServer, name: str) -> str | None:
    """The phase of FillJob ``name`` in NS, None before it has one."""
    return ((get(kube, "fj", name) or {}).get("status") or {}).get("phase")
