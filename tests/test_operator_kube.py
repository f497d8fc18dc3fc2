"""The operator on a real kube-apiserver (1.20, RBAC on), running as its ServiceAccount under bubbles.operator.rbac.

What KMock cannot show: every call the operator makes is allowed by exactly those rules (and nothing else is),
real uids, resourceVersions, status subresources, finalizers and Events, and leader election between two
replicas on a real Lease. Most tests drive the operator with ``InMemoryAgents``; the last one runs a real node
agent behind its gRPC service, and a fill process that attaches to it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.kubeapi import OPERATOR_NAMESPACE, OPERATOR_SA, OPERATOR_TOKEN, OPERATOR_USER, ApiServer
from helpers.local_node import LocalNode
from helpers.operator_kube import NS, cluster_fixture, get, phase, until  # noqa: F401  (the cluster fixture)
from helpers.operator_thread import OperatorThread

from bubbles.core.api import FillState
from bubbles.core.resources import JobProgress, NodeReport, StageReport
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import FillPodSettings, fill_pod_node
from bubbles.operator.grpc_agents import GrpcAgents
from bubbles.operator.kube import TOKEN_CHECK_S, Connection, FinalizerConflict, KubeWriter
from bubbles.operator.leader import LeaseElector
from bubbles.operator.rbac import RULES
from bubbles.operator.shell import Operator, OperatorConfig
from bubbles.operator.template import render as template_render

pytestmark = pytest.mark.kube
MIB = 2**20
CYCLE = {"training": "llama", "stage": 0, "stages": 2, "microbatches": 8, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "samples": 5,
         "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                    "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 1024 * MIB}]}


def operator(kube: ApiServer, agents: InMemoryAgents, **kw: Any) -> OperatorThread:
    conn = Connection(kube.url, token=OPERATOR_TOKEN, ca_path=kube.ca_path, namespace=OPERATOR_NAMESPACE)
    cfg = OperatorConfig(interval_s=0.3, lease_namespace=OPERATOR_NAMESPACE, **kw)
    return OperatorThread(Operator(cfg, conn, agents))


def agents_with_bubbles() -> InMemoryAgents:
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", (StageReport(NS, "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    return agents


def fill_job(name: str) -> str:
    return json.dumps({"apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob",
                       "metadata": {"name": name, "namespace": NS},
                       "spec": {"image": "fill:1", "entry": "pkg.mod:Job",
                                "profile": {"memory": "64Mi", "stepTime": "2ms"}, "work": {"steps": 1000}}})


def contained(expected: Any, actual: Any) -> bool:
    """Whether ``actual`` has everything ``expected`` has (dicts: every key, recursively; lists: item by item, where the
    API server may append its own, as its DefaultTolerationSeconds admission appends two tolerations)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and contained(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(actual, list) and len(expected) <= len(actual) and \
            all(contained(e, a) for e, a in zip(expected, actual, strict=False))
    return bool(expected == actual)


def differences(expected: Any, actual: Any, where: str = "") -> Any:
    """Where ``contained`` fails: (path, expected, actual)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for k, v in expected.items():
            yield from differences(v, actual.get(k), f"{where}.{k}")
    elif isinstance(expected, list) and isinstance(actual, list) and len(expected) <= len(actual):
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            yield from differences(e, a, f"{where}[{i}]")
    elif not contained(expected, actual):
        yield where, expected, actual


def can_i(kube: ApiServer, verb: str, resource: str) -> bool:
    """``kubectl auth can-i`` as the operator; ``resource`` may name a subresource as plural.group/sub."""
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    proc = kube.kubectl("auth", "can-i", verb, resource, *extra, "-n", NS, f"--as={OPERATOR_USER}", check=False)
    return proc.stdout.strip() == "yes"


def test_the_operator_is_granted_exactly_what_it_uses(cluster: ApiServer) -> None:
    for rule in RULES:
        group = rule["apiGroups"][0]
        for resource in rule["resources"]:
            base, _, sub = resource.partition("/")
            full = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
            for verb in rule["verbs"]:
                assert can_i(cluster, verb, full), f"{verb} {full} should be allowed"
    for verb, resource in (("delete", "filljobs.bubbles.dev"), ("update", "filljobs.bubbles.dev"),
                           ("create", "filljobs.bubbles.dev"), ("patch", "pods"), ("update", "pods"),
                           ("get", "secrets"), ("list", "secrets"), ("create", "deployments.apps"),
                           ("delete", "leases.coordination.k8s.io"), ("delete", "events"),
                           ("patch", "pipelinetrainings.bubbles.dev")):
        assert not can_i(cluster, verb, resource), f"{verb} {resource} must not be granted"


def test_place_then_delete_on_a_real_api_server_under_rbac(cluster: ApiServer) -> None:
    agents = agents_with_bubbles()
    op = operator(cluster, agents)
    try:
        cluster.kubectl("create", "-f", "-", input_text=fill_job("resnet"))
        until("Placed", lambda: phase(cluster, "resnet") == "Placed")
        fj = get(cluster, "fj", "resnet")
        assert fj is not None
        uid = fj["metadata"]["uid"]
        assert fj["metadata"]["finalizers"] == ["bubbles.dev/fill-job-cleanup"]
        assert fj["status"]["assignment"]["trainingPod"] == "llama-0" and fj["status"]["observedGeneration"] == 1
        pod = get(cluster, "pod", "fj-resnet-a0")
        assert pod is not None
        assert fill_pod_node(pod["spec"]) == "node-a"
        assert "nodeName" not in pod["spec"]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid  # a real uid now
        # What `bubbles template` prints for this placement is what the operator created (the API server adds only
        # its defaults: every field the template has, the created Pod has, with the same value).
        printed = template_render(fj, node="node-a", stage=0, device="cuda:0", training="llama",
                                  training_pod="llama-0", tolerations=(), gpu_uuid=None, attempt=0,
                                  settings=FillPodSettings())
        assert contained(printed, pod), list(differences(printed, pod))
        events = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout)["items"]
        story = [e["reason"] for e in events if e["involvedObject"]["name"] == "resnet"]
        assert story == ["Placed"]  # admitted and placed in one round: one Event
        row = cluster.kubectl("get", "fj", "resnet", "-n", NS, "--no-headers").stdout.split()
        assert row[1:5] == ["Placed", "llama", "node-a", "0%"]
        # A training's figures are rewritten at most every 5 s (OperatorConfig.training_status_interval_s).
        pt = until("the training counts its fill job",
                   lambda: (p := get(cluster, "pt", "llama")) and p["status"].get("fillJobs") == 1 and p, 15)
        assert pt["status"]["bubbleRatio"] == 0.1
        # Its process runs, then its training falls silent: Paused, a phase the CRD's schema accepts, shown by kubectl.
        agents.reports["node-a"] = NodeReport("node-a", agents.reports["node-a"].stages,
                                              (JobProgress(uid, FillState.RUNNING, 100, 1e12),))
        until("Running", lambda: phase(cluster, "resnet") == "Running")
        agents.reports["node-a"] = NodeReport("node-a", (StageReport(NS, "llama", "llama-0", 0, "cuda:0", CYCLE,
                                                                     False),), agents.reports["node-a"].jobs)
        until("Paused", lambda: phase(cluster, "resnet") == "Paused")
        row = cluster.kubectl("get", "fj", "resnet", "-n", NS, "--no-headers").stdout.split()
        assert row[1:5] == ["Paused", "llama", "node-a", "10%"]
        cluster.kubectl("delete", "fj", "resnet", "-n", NS, "--wait=false")
        until("the FillJob gone (finalizer released)", lambda: get(cluster, "fj", "resnet") is None)
        # No scheduler here: the Pod is unbound and goes at once (a bound one would stay Terminating without a kubelet).
        until("its Pod deleted", lambda: (get(cluster, "pod", "fj-resnet-a0") or {"metadata": {"deletionTimestamp": 1}})
              ["metadata"].get("deletionTimestamp"))
        assert (("node-a", uid) in agents.cancelled)
    finally:
        op.close()


def test_a_pod_the_api_server_refuses_is_said_on_its_fill_job_and_placed_once_admitted(cluster: ApiServer) -> None:
    """A LimitRange (admission, as a ResourceQuota or Pod Security would be) refuses the fill Pod: its container gets
    the namespace's default memory limit, over the namespace's limit per Pod. The FillJob says so in its status and a
    Warning Event, with the API server's words, instead of waiting in silence; once the LimitRange is gone, the job
    is placed."""
    limits = json.dumps({"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "tiny", "namespace": NS},
                         "spec": {"limits": [{"type": "Container", "default": {"memory": "2Mi"}},
                                             {"type": "Pod", "max": {"memory": "1Mi"}}]}})
    cluster.kubectl("apply", "-f", "-", input_text=limits)
    op = operator(cluster, agents_with_bubbles(), pod_retry_s=1.0)
    try:
        cluster.kubectl("create", "-f", "-", input_text=fill_job("refused"))
        fj = until("the refusal on the FillJob", lambda: (f := get(cluster, "fj", "refused")) and "refused its Pod"
                   in ((f.get("status") or {}).get("message") or "") and f)
        assert fj["status"]["phase"] == "Queued"
        assert "403" in fj["status"]["message"] and "maximum memory usage per Pod is 1Mi" in fj["status"]["message"]
        events = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout)["items"]
        assert [e["type"] for e in events if e["involvedObject"]["name"] == "refused"
                and e["reason"] == "PodRefused"] == ["Warning"]
        assert get(cluster, "pod", "fj-refused-a0") is None
        cluster.kubectl("delete", "limitrange", "tiny", "-n", NS)
        until("placed once the Pod is admitted", lambda: phase(cluster, "refused") == "Placed", 20)
        assert get(cluster, "pod", "fj-refused-a0") is not None
        assert op.op.pod_refusals == {}
    finally:
        cluster.kubectl("delete", "limitrange", "tiny", "-n", NS, "--ignore-not-found")
        cluster.kubectl("delete", "fj", "refused", "-n", NS, "--wait=false", "--ignore-not-found")
        until("the FillJob gone (its finalizer released)", lambda: get(cluster, "fj", "refused") is None)
        op.close()


def test_a_fill_pod_the_kubelet_cannot_start_is_said_then_given_up_and_a_bad_training_says_why(
        cluster: ApiServer) -> None:
    """The kubelet's part played by a status write: the fill Pod waits in ImagePullBackOff. Its FillJob says so at
    once (status and a Warning Event); once the Pod is older than --fill-pod-start-timeout (its creation time is the
    API server's), the job is taken off its stage and placed again in a new Pod. A PipelineTraining the CRD accepts
    but the operator cannot read (an empty selector) says why in its status."""
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({
        "apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining", "metadata": {"name": "bad", "namespace": NS},
        "spec": {"selector": {}}}))  # the CRD requires a selector; an empty one selects nothing
    op = operator(cluster, agents_with_bubbles(), pod_start_timeout_s=8.0)
    try:
        pt = until("the bad training's status", lambda: (p := get(cluster, "pt", "bad")) and (p.get("status") or {})
                   .get("conditions") and p)
        admitted = next(c for c in pt["status"]["conditions"] if c["type"] == "Admitted")
        assert admitted["reason"] == "InvalidSpec" and "spec.selector" in admitted["message"]
        cluster.kubectl("create", "-f", "-", input_text=fill_job("unpulled"))
        until("its Pod", lambda: get(cluster, "pod", "fj-unpulled-a0"))
        code, body = cluster.request(
            "PATCH", f"/api/v1/namespaces/{NS}/pods/fj-unpulled-a0/status",
            {"status": {"phase": "Pending", "containerStatuses": [{
                "name": "fill", "ready": False, "restartCount": 0, "image": "fill:1", "imageID": "",
                "state": {"waiting": {"reason": "ErrImagePull", "message": 'pull access denied for fill'}}}]}},
            content_type="application/merge-patch+json")
        assert code == 200, body
        fj = until("the failure said", lambda: (f := get(cluster, "fj", "unpulled")) and "has not started" in
                   ((f.get("status") or {}).get("message") or "") and f)
        assert fj["status"]["phase"] == "Placed" and "its image cannot be pulled" in fj["status"]["message"]
        fj = until("given up and placed again", lambda: (f := get(cluster, "fj", "unpulled")) and
                   f["status"].get("restarts") == 1 and f["status"].get("phase") == "Placed" and f, 30)
        assert fj["status"]["assignment"]["pod"] == "fj-unpulled-a1"
        assert (get(cluster, "pod", "fj-unpulled-a0") or {"metadata": {"deletionTimestamp": 1}})["metadata"].get(
            "deletionTimestamp")
        events = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout)["items"]
        reasons = [(e["involvedObject"]["name"], e["type"], e["reason"]) for e in events
                   if e["involvedObject"]["name"] in ("unpulled", "bad")]
        assert ("unpulled", "Warning", "PodNotStarting") in reasons and ("bad", "Warning", "InvalidSpec") in reasons
    finally:
        cluster.kubectl("delete", "pt", "bad", "-n", NS, "--ignore-not-found")
        cluster.kubectl("delete", "fj", "unpulled", "-n", NS, "--wait=false", "--ignore-not-found")
        until("the FillJob gone (its finalizer released)", lambda: get(cluster, "fj", "unpulled") is None)
        op.close()


def test_two_replicas_elect_one_leader_and_the_other_takes_over(cluster: ApiServer) -> None:
    agents = agents_with_bubbles()
    a = operator(cluster, agents, leader_election=True, identity="replica-a", lease_s=4, renew_s=0.5)
    until("replica-a leads", lambda: a.op.acting)
    b = operator(cluster, agents, leader_election=True, identity="replica-b", lease_s=4, renew_s=0.5)
    try:
        cluster.kubectl("create", "-f", "-", input_text=fill_job("first"))
        until("first Placed", lambda: phase(cluster, "first") == "Placed")
        time.sleep(1.5)  # both replicas run several rounds
        assert a.op.acting and not b.op.acting and b.op.writes_total["pod"] == 0
        a.close()  # the leader goes away (and releases the Lease)
        until("replica-b takes over", lambda: b.op.acting, timeout_s=10)
        cluster.kubectl("delete", "fj", "first", "-n", NS, "--wait=false")
        cluster.kubectl("create", "-f", "-", input_text=fill_job("second"))
        until("second Placed by the new leader", lambda: phase(cluster, "second") == "Placed")
        # The write counts are updated when a round ends, just after the status the test saw.
        until("the new leader's round ends", lambda: b.op.writes_total["pod"] >= 1)
        time.sleep(1.0)
        assert a.op.writes_total["pod"] == 1 and b.op.writes_total["pod"] == 1  # nothing ran twice
        lease = json.loads(cluster.kubectl("get", "lease", "bubbles-operator", "-n", OPERATOR_NAMESPACE,
                                           "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"] == "replica-b"
    finally:
        b.close()
        if a.thread.is_alive():
            a.close()
        cluster.kubectl("delete", "fj", "--all", "-n", NS, "--wait=false", check=False)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_operator_command_stops_on_a_signal_and_releases_its_lease(cluster: ApiServer, sig: signal.Signals,
                                                                        tmp_path: Path) -> None:
    """The real ``bubbles operator`` as a Pod runs it: the kubelet's SIGTERM (Ctrl-C's SIGINT by hand) ends it within
    seconds, with its Lease released so another replica takes over at once instead of waiting for it to expire."""
    lease_name = f"stop-{sig.name.lower()}"
    log = (tmp_path / "operator.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bubbles.cli", "operator", "--kubeconfig", str(cluster.operator_kubeconfig),
         "--lease-name", lease_name, "--lease-namespace", OPERATOR_NAMESPACE, "--identity", "replica-sig",
         "--interval", "0.3", "--metrics-port", "0", "--namespace", NS],
        stdout=log, stderr=subprocess.STDOUT)

    def holder() -> str | None:
        got = cluster.kubectl("get", "lease", lease_name, "-n", OPERATOR_NAMESPACE, "-o", "json", check=False)
        return json.loads(got.stdout)["spec"].get("holderIdentity") if got.returncode == 0 else None

    try:
        until("the operator holds its Lease", lambda: holder() == "replica-sig", timeout_s=60)
        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=10)
        took_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    said = (tmp_path / "operator.log").read_text()
    assert code == 0, said[-3000:]
    assert took_s < 10
    assert holder() in (None, ""), said[-3000:]  # released: the next replica takes it at once


def bound_token(kube: ApiServer, secret: str) -> str:
    """A token of the operator's ServiceAccount from the TokenRequest API, bound to Secret ``secret``: deleting the
    Secret revokes it, as a bound token stops working when its Pod goes or it expires."""
    status, _ = kube.request("POST", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets",
                             {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}})
    assert status == 201, status
    _, got = kube.request("GET", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets/{secret}")
    status, answer = kube.request(
        "POST", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{OPERATOR_SA}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600,
                  "boundObjectRef": {"apiVersion": "v1", "kind": "Secret", "name": secret,
                                     "uid": got["metadata"]["uid"]}}})
    assert status == 201, answer
    return str(answer["status"]["token"])


def test_a_rotated_token_keeps_the_operator_working_after_the_old_one_is_revoked(cluster: ApiServer,
                                                                                 tmp_path: Path) -> None:
    """The kubelet renews a Pod's projected ServiceAccount token in its file before the old one expires: the running
    operator must follow the file, its watches (kopf) and its writes (the client) alike."""
    status, _ = cluster.request("POST", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts",
                                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_SA}})
    assert status in (201, 409), status
    first, second = bound_token(cluster, "token-first"), bound_token(cluster, "token-second")
    token_file = tmp_path / "token"
    token_file.write_text(first)
    conn = Connection(cluster.url, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE, token_file=str(token_file))
    cfg = OperatorConfig(interval_s=0.3, lease_namespace=OPERATOR_NAMESPACE, leader_election=True,
                         identity="rotating", lease_name="rotating", lease_s=4, renew_s=0.5)
    op = OperatorThread(Operator(cfg, conn, agents_with_bubbles()))
    try:
        until("the operator leads", lambda: op.op.acting)
        cluster.kubectl("create", "-f", "-", input_text=fill_job("before-rotation"))
        until("Placed with the first token", lambda: phase(cluster, "before-rotation") == "Placed")
        renamed = tmp_path / "token.new"
        renamed.write_text(second)
        renamed.replace(token_file)
        time.sleep(2 * TOKEN_CHECK_S)
        cluster.kubectl("delete", "secret", "token-first", "-n", OPERATOR_NAMESPACE)
        assert until("the first token revoked", lambda: cluster.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/rotating",
            token=first)[0] == 401)
        # The stage is the first job's: deleting it (the operator deletes its Pod and lets its finalizer go) frees it
        # for the next one, which the operator then places; every write with the second token.
        cluster.kubectl("delete", "fj", "before-rotation", "-n", NS, "--wait=false")
        cluster.kubectl("create", "-f", "-", input_text=fill_job("after-rotation"))
        until("the first FillJob gone (its finalizer let go)", lambda: get(cluster, "fj", "before-rotation") is None)
        until("Placed with the second token", lambda: phase(cluster, "after-rotation") == "Placed")
        time.sleep(1.0)
        assert op.op.acting  # its Lease renewed throughout
    finally:
        op.close()
        cluster.kubectl("delete", "fj", "--all", "-n", NS, "--wait=false", check=False)


def test_a_stale_lease_is_taken_over_by_the_observers_clock_not_by_its_renew_time(cluster: ApiServer) -> None:
    conn = Connection(cluster.url, token=OPERATOR_TOKEN, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE)
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "skewed", "namespace": OPERATOR_NAMESPACE},
        # A holder whose clock runs years behind ours: by wall clocks it expired long ago.
        "spec": {"holderIdentity": "ghost", "leaseDurationSeconds": 2, "renewTime": "2000-01-01T00:00:00.000000Z"}}))
    elector = LeaseElector(conn.api_client(), OPERATOR_NAMESPACE, "skewed", "b", lease_s=2, renew_s=0.2)
    t0 = time.monotonic()
    assert elector.try_once() is False  # first seen now: it must stand still for 2 s by our clock
    until("taken over", elector.try_once, timeout_s=10)
    assert time.monotonic() - t0 >= 2.0
    lease = json.loads(cluster.kubectl("get", "lease", "skewed", "-n", OPERATOR_NAMESPACE, "-o", "json").stdout)
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1


def test_finalizers_are_written_against_the_version_they_were_computed_from(cluster: ApiServer) -> None:
    conn = Connection(cluster.url, token=OPERATOR_TOKEN, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE)
    writer = KubeWriter(conn, request_timeout_s=10)
    cluster.kubectl("create", "-f", "-", input_text=fill_job("fin"))
    try:
        fj = get(cluster, "fj", "fin")
        assert fj is not None
        stale = fj["metadata"]["resourceVersion"]
        cluster.kubectl("label", "fj", "fin", "-n", NS, "touched=yes")  # someone else writes in between
        with pytest.raises(FinalizerConflict, match="written again next round"):
            writer.set_finalizer("filljobs", NS, "fin", True, [], stale)
        fresh = get(cluster, "fj", "fin")
        assert fresh is not None and not fresh["metadata"].get("finalizers")
        done = writer.set_finalizer("filljobs", NS, "fin", True, [], fresh["metadata"]["resourceVersion"])
        assert done is not None and done["metadata"]["finalizers"] == ["bubbles.dev/fill-job-cleanup"]
        writer.set_finalizer("filljobs", NS, "fin", False, done["metadata"]["finalizers"],
                             done["metadata"]["resourceVersion"])
    finally:
        cluster.kubectl("delete", "fj", "fin", "-n", NS, "--wait=false", check=False)


def test_a_pod_of_the_same_name_from_another_placement_is_replaced_not_trusted(cluster: ApiServer) -> None:
    # A leftover of a round whose status write was lost: the attempt's Pod name, another placement (here unbound,
    # so that it goes at once without a kubelet).
    cluster.kubectl("create", "-f", "-", input_text=json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "fj-clash-a0", "namespace": NS, "annotations": {"bubbles.dev/fill-job-uid": "other"}},
        "spec": {"automountServiceAccountToken": False, "containers": [{"name": "fill", "image": "fill:0"}]}}))
    op = operator(cluster, agents_with_bubbles())
    try:
        cluster.kubectl("create", "-f", "-", input_text=fill_job("clash"))
        until("Placed", lambda: phase(cluster, "clash") == "Placed")
        fj = get(cluster, "fj", "clash")
        pod = get(cluster, "pod", "fj-clash-a0")
        assert fj is not None and pod is not None
        assert pod["metadata"]["annotations"]["bubbles.dev/fill-job-uid"] == fj["metadata"]["uid"]
        assert fill_pod_node(pod["spec"]) == "node-a"
    finally:
        op.close()
        cluster.kubectl("delete", "fj", "--all", "-n", NS, "--wait=false", check=False)


def test_a_fill_pod_with_a_claim_waits_for_the_scheduler_and_is_not_taken_for_another_placement(
        cluster: ApiServer) -> None:
    """A fill Pod with a PersistentVolumeClaim is pinned by affinity, not nodeName (the scheduler must bind a
    WaitForFirstConsumer claim): until it is scheduled it has no node, and creating it again (a round whose status
    write was lost) must find it the same placement, not delete it."""
    from bubbles.core.resources import FillJobResource
    from bubbles.operator.decide import FillPodSettings, fill_pod
    from bubbles.operator.decide import fill_pod_place as on_node

    job = FillJobResource.from_object({
        "metadata": {"name": "claimed", "namespace": NS, "uid": "u-claimed"},
        "spec": {"image": "fill:1", "entry": "m:C", "profile": {"memory": "16Mi"}, "work": {"steps": 1},
                 "volumes": [{"name": "data", "mountPath": "/data", "persistentVolumeClaim": {"claimName": "d"}}]}})
    from bubbles.operator.decide import Assignment

    a = Assignment(job.uid, 1, NS, job.name, f"{NS}/llama", 0, "node-a", "llama-0", "cuda:0", "fj-claimed-a0", 0,
                   None, job.job)
    manifest = fill_pod(job, a, FillPodSettings())
    assert "nodeName" not in manifest["spec"] and manifest["spec"]["affinity"] == on_node("node-a")["affinity"]
    manifest["metadata"].pop("ownerReferences")  # no FillJob object of that uid here
    conn = Connection(cluster.url, token=OPERATOR_TOKEN, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE)
    writer = KubeWriter(conn, request_timeout_s=10)
    try:
        assert writer.create_pod(manifest) is True
        made = get(cluster, "pod", "fj-claimed-a0")
        assert made is not None and not made["spec"].get("nodeName")  # no scheduler in this tier: unscheduled
        assert made["spec"]["tolerations"][0] == {"operator": "Exists", "effect": "NoSchedule"}
        assert writer.create_pod(manifest) is False  # the same placement: kept
        again = get(cluster, "pod", "fj-claimed-a0")
        assert again is not None and again["metadata"]["uid"] == made["metadata"]["uid"]
    finally:
        cluster.kubectl("delete", "pod", "fj-claimed-a0", "-n", NS, "--wait=false", check=False)


def test_a_fill_job_runs_to_the_end_through_a_real_node_agent(cluster: ApiServer, tmp_path: Path) -> None:
    """The whole path but the kubelet: FillJob -> operator (RBAC, real API server) -> gRPC with mutual TLS -> the
    node's agent -> the fill Pod's process (started here with the Pod's own command and environment, as the kubelet
    would) attaches, runs in the bubbles the test's hook signals, finishes -> Succeeded."""
    node_name, training = "node-e2e", "e2e"
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining",
         "metadata": {"name": training, "namespace": NS}, "spec": {"selector": {"matchLabels": {"app": training}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{training}-0", "namespace": NS,
                                                         "labels": {"app": training}},
         "spec": {"nodeName": node_name, "automountServiceAccountToken": False,
                  "containers": [{"name": "train", "image": "train:1"}]}}]}))
    node = LocalNode(node_name, NS, training, f"{training}-0", tmp_path)
    agents = GrpcAgents({node_name: node.address}.get, node.client_security)
    conn = Connection(cluster.url, token=OPERATOR_TOKEN, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE)
    op = OperatorThread(Operator(OperatorConfig(interval_s=0.3, lease_namespace=OPERATOR_NAMESPACE), conn, agents))
    try:
        cluster.kubectl("create", "-f", "-", input_text=json.dumps({
            "apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob", "metadata": {"name": "spin", "namespace": NS},
            "spec": {"image": "fill:1", "entry": "bubbles.fill_examples.spin:SpinJob", "args": {"step_us": 500},
                     "trainingSelector": {"matchLabels": {}}, "profile": {"memory": "16Mi", "stepTime": "1ms"},
                     "work": {"steps": 300}}}))
        until("Placed", lambda: phase(cluster, "spin") in ("Placed", "Running"))
        fj = get(cluster, "fj", "spin")
        assert fj is not None and fj["status"]["assignment"]["training"] == training
        until("the agent holds the assignment",
              lambda: any(j.message.name == "spin" for j in node.node.book.jobs.values()))
        pod = get(cluster, "pod", "fj-spin-a0")
        assert pod is not None
        assert fill_pod_node(pod["spec"]) == node_name
        proc = node.start_pod(cluster, "fj-spin-a0")
        until("Running", lambda: phase(cluster, "spin") == "Running", timeout_s=60)
        until("Succeeded", lambda: phase(cluster, "spin") == "Succeeded", timeout_s=120)
        assert proc.wait(timeout=30) == 0
        fj = get(cluster, "fj", "spin")
        assert fj is not None and fj["status"]["progress"]["stepsDone"] == 300
        events = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout)["items"]
        story = [e["reason"] for e in events if e["involvedObject"]["name"] == "spin"]
        assert story[0] == "Placed" and "Running" in story and story[-1] == "Succeeded"
    finally:
        op.close()
        node.close()
        cluster.kubectl("delete", "fj", "--all", "-n", NS, "--wait=false", check=False)


def test_the_templated_pod_is_accepted_by_the_real_api_server(cluster: ApiServer, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """What ``bubbles template`` prints is a Pod the API server takes as it is (a server-side dry run: its schema,
    defaulting and admission, nothing stored), so a policy engine checks what will really be created."""
    from bubbles.cli import main

    path = tmp_path / "fj.yaml"
    path.write_text(fill_job("templated"))  # JSON is YAML
    assert main(["template", str(path), "--node", "node-a", "--stage", "0", "--training", "llama",
                 "--gpu-uuid", "GPU-1", "--gpu-resource", "bubbles.dev/gpu-1", "--fill-run-as-user", "1000",
                 "--training-pod-tolerations", json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists"}])]) == 0
    printed = capsys.readouterr().out
    proc = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input_text=printed, check=False)
    assert proc.returncode == 0, proc.stderr
    accepted = json.loads(proc.stdout)
    assert accepted["spec"]["affinity"]["nodeAffinity"]
    assert get(cluster, "pod", "fj-templated-a0") is None  # a dry run: nothing was created


def test_two_ranks_of_one_pods_stage_take_a_fill_job_each_and_the_status_lists_both_gpus(
        cluster: ApiServer) -> None:
    """llama-0 runs stage 0 on two GPUs (tensor-parallel ranks 0 and 1): two FillJobs are placed, one per GPU, each
    status naming its rank and GPU, and the PipelineTraining's status lists both GPUs: through the CRD's schema
    (nothing pruned) and kubectl's columns. A FillJob pinned to a stage the training does not have says so."""
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", tuple(
        StageReport(NS, "llama", "llama-0", 0, f"cuda:{r}", CYCLE, True, gpu_uuid=f"GPU-{r}", rank=r, ranks=2,
                    gpu_resource=f"bubbles.dev/gpu-{r}")
        for r in (0, 1)))
    bad = json.loads(fill_job("tp-nowhere"))
    bad["spec"]["stage"] = 9
    bad["spec"]["trainingSelector"] = {"matchLabels": {"team": "a"}}  # llama alone (other tests leave trainings)
    negative = json.loads(fill_job("tp-negative"))
    negative["spec"]["stage"] = -1
    refused = cluster.kubectl("create", "-f", "-", input_text=json.dumps(negative), check=False)
    assert refused.returncode != 0 and "spec.stage" in refused.stderr
    op = operator(cluster, agents)
    try:
        for name in ("tp-a", "tp-b"):
            cluster.kubectl("create", "-f", "-", input_text=fill_job(name))
        cluster.kubectl("create", "-f", "-", input_text=json.dumps(bad))
        for name in ("tp-a", "tp-b"):
            until(f"{name} Placed", lambda n=name: phase(cluster, n) == "Placed")
        placed = [get(cluster, "fj", n)["status"]["assignment"] for n in ("tp-a", "tp-b")]  # type: ignore[index]
        assert sorted((p["stage"], p["ranks"], p["gpuUUIDs"]) for p in placed) == \
            [(0, [0], ["GPU-0"]), (0, [1], ["GPU-1"])]
        assert sorted(a.ranks for a in agents.assigned) == [(0,), (1,)]
        pt = until("the training's status lists both GPUs harvested", lambda: (
            p := get(cluster, "pt", "llama")) and p["status"].get("gpusHarvested") == 2 and p, 15)
        (s0,) = pt["status"]["stages"]
        assert s0["stage"] == 0 and s0["ranks"] == 2
        assert [(g["rank"], g["pod"], g["node"], g["device"], g["gpuUUID"], g["hookReporting"], g["fillJobs"])
                for g in s0["gpus"]] == [(0, "llama-0", "node-a", "cuda:0", "GPU-0", True, 1),
                                         (1, "llama-0", "node-a", "cuda:1", "GPU-1", True, 1)]
        assert all(g["bubbleRatio"] == 0.1 and g["bubbles"][0]["freeBytes"] == 1024 * MIB for g in s0["gpus"])
        header, row = cluster.kubectl("get", "pt", "llama", "-n", NS).stdout.splitlines()
        assert header.split()[1:3] == ["GPUS", "HARVESTED"] and row.split()[1:3] == ["2", "2"]
        nowhere = until("the pinned job says its stage is none of the training's",
                        lambda: (f := get(cluster, "fj", "tp-nowhere")) and (f.get("status") or {}).get("message")
                        and f)
        assert nowhere["status"]["phase"] == "Queued"
        assert "spec.stage 9 is no stage of the PipelineTrainings it may use: harvest/llama has 2 (0-1)" in \
            nowhere["status"]["message"]
        events = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout)["items"]
        assert [e["type"] for e in events if e["involvedObject"]["name"] == "tp-nowhere"
                and e["reason"] == "NoSuchStage"] == ["Warning"]
    finally:
        cluster.kubectl("delete", "fj", "tp-a", "tp-b", "tp-nowhere", "-n", NS, "--wait=false", "--ignore-not-found")
        for name in ("tp-a", "tp-b", "tp-nowhere"):
            until(f"{name} gone (its finalizer released)", lambda n=name: get(cluster, "fj", n) is None)
        op.close()


def test_a_gang_is_placed_on_both_ranks_of_a_stage_and_the_crd_refuses_gpus_0(cluster: ApiServer) -> None:
    """llama-0 runs stage 0 ranks 0 and 1: a FillJob of gpus: 2 is placed on both at once, its status (through the
    CRD's schema: nothing pruned) lists both ranks and GPUs, its one Pod sees both, and the training's status counts
    both GPUs harvested by it. The CRD refuses gpus: 0 before the operator sees it."""
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", tuple(
        StageReport(NS, "llama", "llama-0", 0, f"cuda:{r}", CYCLE, True, gpu_uuid=f"GPU-{r}", rank=r, ranks=2,
                    gpu_resource=f"bubbles.dev/gpu-{r}")
        for r in (0, 1)))
    zero = json.loads(fill_job("gang-zero"))
    zero["spec"]["gpus"] = 0
    refused = cluster.kubectl("create", "-f", "-", input_text=json.dumps(zero), check=False)
    assert refused.returncode != 0 and "spec.gpus" in refused.stderr
    gang = json.loads(fill_job("gang"))
    gang["spec"]["gpus"] = 2
    gang["spec"]["trainingSelector"] = {"matchLabels": {"team": "a"}}  # llama alone (other tests leave trainings)
    op = operator(cluster, agents)
    try:
        cluster.kubectl("create", "-f", "-", input_text=json.dumps(gang))
        until("the gang Placed", lambda: phase(cluster, "gang") == "Placed")
        a = get(cluster, "fj", "gang")["status"]["assignment"]  # type: ignore[index]
        assert (a["stage"], a["ranks"], a["gpuUUIDs"]) == (0, [0, 1], ["GPU-0", "GPU-1"])
        assert [x.ranks for x in agents.assigned] == [(0, 1)]
        pod = until("the gang's Pod", lambda: get(cluster, "pod", "fj-gang-a0"))
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1" and env["BUBBLES_RANKS"] == "0,1"
        # Both GPUs' resources, as the real API server stores them; the Pod's one CSI volume.
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"bubbles.dev/gpu-0": "1",
                                                                       "bubbles.dev/gpu-1": "1"}
        assert [v["csi"]["driver"] for v in pod["spec"]["volumes"]] == ["csi.bubbles.dev"]
        pt = until("the training's status counts both GPUs harvested", lambda: (
            p := get(cluster, "pt", "llama")) and p["status"].get("gpusHarvested") == 2 and p, 15)
        assert [g["fillJobs"] for g in pt["status"]["stages"][0]["gpus"]] == [1, 1]
        header, row = cluster.kubectl("get", "fj", "gang", "-n", NS, "-o", "wide").stdout.splitlines()
        assert row.split()[header.split().index("GPUS")] == "2"
    finally:
        cluster.kubectl("delete", "fj", "gang", "-n", NS, "--wait=false", "--ignore-not-found")
        until("gang gone (its finalizer released)", lambda: get(cluster, "fj", "gang") is None)
        op.close()
