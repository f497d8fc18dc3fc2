"""Who may start on a GPU's fill slots (issue 36): the device plugin's PreStartContainer decision, pure, over the
kubelet's listing of every container's devices and the fill Pods assigned on this node; and the node agent's side,
the assignments it holds with their GPUs (a real ``NodeAgent`` reading real hook cards). No gRPC here
(tests/test_device_plugin_kubelet.py calls it as the kubelet does)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers.agent import TRAINING, short_tmp
from helpers.agent_cluster import NODE, assignment, write_card

from bubbles.agent.cluster import ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.deviceplugin.decide import gpus_from_devices, plan_resources
from bubbles.agent.deviceplugin.guard import ONLY_FILL_PODS, FillPodGpus, Refusal, check_pre_start
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.podresources import ContainerDevices
from bubbles.core.api import IsolationMode

__all__ = ["short_tmp"]

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"
GPU0, GPU1, GPU2 = "bubbles.dev/gpu-0", "bubbles.dev/gpu-1", "bubbles.dev/gpu-2"
SERVED = plan_resources(gpus_from_devices({A: "cuda:0", B: "cuda:1", C: "cuda:2"}), 4)
FILL = FillPodGpus("ml", "fj-infer-a0", "infer", "ml/llama", (A,))
GANG = FillPodGpus("ml", "fj-gang-a0", "gang", "ml/llama", (A, B))


def held(pod: str, resource: str, *ids: str, namespace: str = "ml", container: str = "main") -> ContainerDevices:
    return ContainerDevices(namespace, pod, container, resource, ids)


def check(resource: str, ids: Sequence[str], listing: Sequence[ContainerDevices],
          assigned: Sequence[FillPodGpus] = (FILL, GANG)) -> Refusal | None:
    return check_pre_start(SERVED, resource, ids, listing, assigned)


def test_the_assigned_fill_pod_starts_on_its_gpu() -> None:
    listing = [held("other", "example.com/nic", "n0"), held("fj-infer-a0", GPU0, f"{A}::2")]
    assert check(GPU0, [f"{A}::2"], listing) is None
    # Two containers of the fill Pod on slots of its GPU, and another fill Pod on another slot of it: each may start.
    listing += [held("fj-infer-a0", GPU0, f"{A}::3", container="side"), held("fj-gang-a0", GPU0, f"{A}::0")]
    assert check(GPU0, [f"{A}::3"], listing) is None


def test_a_pod_no_fillJob_made_is_refused_saying_to_create_one() -> None:
    listing = [held("fj-infer-a0", GPU0, f"{A}::0"), held("notebook", GPU0, f"{A}::1", namespace="alice")]
    got = check(GPU0, [f"{A}::1"], listing)
    assert got is not None and got.code == "PERMISSION_DENIED"
    assert got.message == ("bubbles device plugin: Pod alice/notebook requests a bubbles.dev/gpu-* resource but is not "
                           f"a fill Pod the bubbles operator assigned to this node: {ONLY_FILL_PODS}")
    assert ONLY_FILL_PODS.endswith("create a FillJob")
    # A fill Pod's name in another namespace is another Pod.
    got = check(GPU0, [f"{A}::2"], [held("fj-infer-a0", GPU0, f"{A}::2", namespace="web")])
    assert got is not None and "Pod web/fj-infer-a0 requests" in got.message


def test_an_assigned_fill_pod_asking_another_trainings_gpu_is_refused_naming_both() -> None:
    got = check(GPU2, [f"{C}::0"], [held("fj-infer-a0", GPU2, f"{C}::0")])
    assert got is not None and got.code == "PERMISSION_DENIED"
    assert (f"fill Pod ml/fj-infer-a0 (FillJob infer) is assigned GPU(s) {A} of training ml/llama; it requests "
            f"bubbles.dev/gpu-2 (GPU {C}) of another training") in got.message
    # Its own GPU and another one in one Pod: the call for its own GPU refuses it too (no start on half the check).
    both = [held("fj-infer-a0", GPU0, f"{A}::0"), held("fj-infer-a0", GPU2, f"{C}::1", container="side")]
    got = check(GPU0, [f"{A}::0"], both)
    assert got is not None and f"it requests bubbles.dev/gpu-2 (GPU {C})" in got.message


def test_a_gangs_pod_starts_with_its_two_gpus_and_not_with_a_third() -> None:
    listing = [held("fj-gang-a0", GPU0, f"{A}::1"), held("fj-gang-a0", GPU1, f"{B}::0")]
    assert check(GPU0, [f"{A}::1"], listing) is None
    assert check(GPU1, [f"{B}::0"], listing) is None  # the kubelet calls each resource's plugin
    listing.append(held("fj-gang-a0", GPU2, f"{C}::3"))
    for resource, ids in ((GPU0, [f"{A}::1"]), (GPU2, [f"{C}::3"])):
        got = check(resource, ids, listing)
        assert got is not None and f"is assigned GPU(s) {A}, {B} of training ml/llama" in got.message
        assert f"it requests bubbles.dev/gpu-2 (GPU {C})" in got.message


def test_a_cancelled_assignment_no_longer_lets_its_pod_start() -> None:
    cancelled = dataclasses.replace(FILL, cancelled="the FillJob was deleted")
    got = check(GPU0, [f"{A}::0"], [held("fj-infer-a0", GPU0, f"{A}::0")], [cancelled])
    assert got is not None and got.code == "PERMISSION_DENIED"
    assert ("fill Pod ml/fj-infer-a0's assignment (FillJob infer, training ml/llama) was cancelled (the FillJob was "
            "deleted): it may no longer run on the training's GPU") in got.message
    # A live assignment of the same Pod (assigned again) counts over the cancelled one.
    assert check(GPU0, [f"{A}::0"], [held("fj-infer-a0", GPU0, f"{A}::0")], [cancelled, FILL]) is None


def test_a_fill_pod_whose_gpu_the_node_does_not_know_yet_is_refused_saying_so() -> None:
    unknown = dataclasses.replace(FILL, gpu_uuids=())
    got = check(GPU0, [f"{A}::0"], [held("fj-infer-a0", GPU0, f"{A}::0")], [unknown])
    assert got is not None and "no GPU of its assignment is known on this node (the training's hook has written no " \
                               "card here yet" in got.message


def test_a_listing_without_the_container_is_refused_as_whose_pod_cannot_be_told() -> None:
    for listing in ([], [held("fj-infer-a0", GPU0, f"{A}::1")], [held("fj-infer-a0", GPU1, f"{A}::0")]):
        got = check(GPU0, [f"{A}::0"], listing)
        assert got is not None and got.code == "FAILED_PRECONDITION"
        assert (f"the kubelet's PodResources API lists no container holding {A}::0 of bubbles.dev/gpu-0, so whose Pod "
                "it is cannot be told") in got.message
    # Two devices, one listed: still refused, naming the other.
    got = check(GPU0, [f"{A}::0", f"{A}::1"], [held("fj-infer-a0", GPU0, f"{A}::0")])
    assert got is not None and f"holding {A}::1 of" in got.message


def test_every_pod_holding_the_devices_must_pass() -> None:
    # The kubelet gives a device to one container at a time; a listing that says otherwise lets nobody through.
    listing = [held("fj-infer-a0", GPU0, f"{A}::0"), held("intruder", GPU0, f"{A}::0")]
    got = check(GPU0, [f"{A}::0"], listing)
    assert got is not None and "Pod ml/intruder requests" in got.message


@pytest.mark.parametrize(("resource", "ids", "code", "needle"), [
    ("nvidia.com/gpu", [f"{A}::0"], "NOT_FOUND", "resource 'nvidia.com/gpu' is not served on this node (served: "
                                                 "bubbles.dev/gpu-0, bubbles.dev/gpu-1, bubbles.dev/gpu-2)"),
    ("bubbles.dev/gpu-7", [f"{A}::0"], "NOT_FOUND", "not served on this node"),
    (GPU0, [], "INVALID_ARGUMENT", "PreStartContainer for bubbles.dev/gpu-0 names no device"),
    (GPU0, [f"{A}::9"], "INVALID_ARGUMENT", f"bubbles.dev/gpu-0 has no device {A}::9 (it advertises 4 slots of GPU "
                                            f"{A})"),
    (GPU0, [f"{B}::0"], "INVALID_ARGUMENT", f"bubbles.dev/gpu-0 has no device {B}::0"),  # another GPU's slot
    (GPU0, ["garbage"], "INVALID_ARGUMENT", "has no device garbage"),
])
def test_a_call_naming_what_the_plugin_does_not_serve_is_refused(resource: str, ids: list[str], code: str,
                                                                 needle: str) -> None:
    listing = [held("fj-infer-a0", GPU0, f"{A}::0"), held("fj-infer-a0", "nvidia.com/gpu", f"{A}::0")]
    got = check(resource, ids, listing)
    assert got is not None and got.code == code and needle in got.message
    assert got.message.startswith("bubbles device plugin: ")


# -- the node agent's side: the assignments it holds, with their GPUs ---------------------------------------------
@pytest.fixture
def node(short_tmp: Path) -> Iterator[NodeAgent]:
    template = AgentConfig(run_dir=short_tmp / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=60.0))
    yield n
    n.stop()


def test_the_node_agent_gives_each_assigned_fill_pod_with_the_gpus_its_cards_name(node: NodeAgent) -> None:
    write_card(node.run_dir, stage=0, rank=0, ranks=2, gpu_uuid=A)
    write_card(node.run_dir, stage=0, rank=1, ranks=2, gpu_uuid=B)
    node.scan()
    assert node.fill_pod_gpus() == ()
    node.assign(assignment(uid="u-one", name="one", gpu_uuid=C))  # the card of rank 0 says A: the card counts
    gang = assignment(uid="u-gang", name="gang", ranks=(0, 1))
    node.assign(dataclasses.replace(gang, spec=dataclasses.replace(gang.spec, gpus=2)))
    node.assign(assignment(uid="u-away", name="away", stage=3, gpu_uuid=C))  # no card of stage 3: its gpu_uuid
    node.assign(assignment(uid="u-gone", name="gone"))
    node.cancel("u-gone", "the FillJob was deleted")
    tr = f"ml/{TRAINING}"
    assert sorted(node.fill_pod_gpus(), key=lambda f: f.pod) == [
        FillPodGpus("ml", "fj-away-a0", "away", tr, (C,)),
        FillPodGpus("ml", "fj-gang-a0", "gang", tr, (A, B)),
        FillPodGpus("ml", "fj-gone-a0", "gone", tr, (A,), cancelled="the FillJob was deleted"),
        FillPodGpus("ml", "fj-one-a0", "one", tr, (A,)),
    ]
    # A gang rank without a card and no UUID of its own: that GPU is not known, the other one is.
    half = assignment(uid="u-half", name="half", stage=0, ranks=(1, 5))
    node.assign(dataclasses.replace(half, spec=dataclasses.replace(half.spec, gpus=2)))
    assert next(f for f in node.fill_pod_gpus() if f.job == "half").gpu_uuids == (B,)
