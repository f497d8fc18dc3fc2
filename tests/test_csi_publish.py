"""What a publish and an unpublish of csi.bubbles.dev mean (bubbles.agent.csi.publish): no socket, no mount.

Every refusal comes with its gRPC status and a message naming the field and what to set; a publish is idempotent; an
unpublish of a volume the plugin does not know is OK (CSI); the book survives its state file."""

from __future__ import annotations

from typing import Any

import pytest

from bubbles.agent.csi.publish import (
    EPHEMERAL_KEY,
    POD_NAME_KEY,
    POD_NAMESPACE_KEY,
    POD_UID_KEY,
    SERVICE_ACCOUNT_KEY,
    PodVolume,
    PublishRequest,
    Refused,
    Role,
    Status,
    book_from_json,
    book_to_json,
    plan_publish,
    plan_unpublish,
)

RUN = "/run/bubbles"
PODS = "/var/lib/kubelet/pods"
UID = "0f6c3a4e-7b1d-4c2a-9e8f-1a2b3c4d5e6f"
UID2 = "5d2e8c1a-0b9f-4e3d-8a7c-6b5a4f3e2d1c"


def target(uid: str = UID, volume: str = "bubbles") -> str:
    """Where the kubelet 1.20 publishes an inline volume of Pod ``uid``."""
    return f"{PODS}/{uid}/volumes/kubernetes.io~csi/{volume}/mount"


def context(uid: str = UID, **extra: str) -> dict[str, str]:
    """volume_context as the kubelet 1.20 sends it for an inline volume, the CSIDriver with podInfoOnMount: true."""
    return {"role": "training", POD_NAME_KEY: "train-0", POD_NAMESPACE_KEY: "ml", POD_UID_KEY: uid,
            SERVICE_ACCOUNT_KEY: "default", EPHEMERAL_KEY: "true", **extra}


def request(volume_id: str = "csi-1f2e", uid: str = UID, **kw: Any) -> PublishRequest:
    return PublishRequest(volume_id, kw.pop("target_path", target(uid)), kw.pop("volume_context", context(uid)), **kw)


def publish(book: dict[str, PodVolume], req: PublishRequest) -> PodVolume:
    plan = plan_publish(book, req, run_dir=RUN, kubelet_pods_dir=PODS)
    book[plan.volume.volume_id] = plan.volume
    return plan.volume


def test_a_training_pods_volume_is_its_own_directory() -> None:
    plan = plan_publish({}, request(), run_dir=RUN, kubelet_pods_dir=PODS)
    assert not plan.already
    assert plan.volume == PodVolume("csi-1f2e", target(), "ml", "train-0", UID, Role.TRAINING, "default",
                                    f"{RUN}/_pods/{UID}")


def test_a_static_pods_uid_and_a_fill_role_are_taken() -> None:
    uid = "6f1d3e0c2b9a8f7e6d5c4b3a29180716"  # a static Pod's uid: a hash of its manifest
    plan = plan_publish({}, request(uid=uid, volume_context=context(uid, role="fill")), run_dir=RUN,
                        kubelet_pods_dir=PODS + "/")
    assert (plan.volume.role, plan.volume.directory) == (Role.FILL, f"{RUN}/_pods/{uid}")


def _without(key: str) -> dict[str, str]:
    c = context()
    del c[key]
    return c


@pytest.mark.parametrize(("req", "status", "needle"), [
    # What the CSIDriver object must say
    (request(volume_context={"role": "training"}), Status.FAILED_PRECONDITION,
     "set podInfoOnMount: true in the CSIDriver csi.bubbles.dev (the chart does)"),
    (request(volume_context=_without(POD_UID_KEY)), Status.FAILED_PRECONDITION, f"no {POD_UID_KEY} in volume_context"),
    (request(volume_context=_without(EPHEMERAL_KEY)), Status.FAILED_PRECONDITION, "podInfoOnMount: true"),
    (request(volume_context=context(**{EPHEMERAL_KEY: "false"})), Status.INVALID_ARGUMENT,
     "serves only inline ephemeral volumes"),
    # What the Pod's volume must say
    (request(volume_context=_without("role")), Status.INVALID_ARGUMENT,
     "volumeAttributes.role is missing: set volumeAttributes: {role: training}"),
    (request(volume_context=context(role="trainer")), Status.INVALID_ARGUMENT,
     "volumeAttributes.role must be training or fill, got 'trainer'"),
    (request(volume_context=context(Role="fill")), Status.INVALID_ARGUMENT,
     "volumeAttributes Role not known to csi.bubbles.dev: its only attribute is role"),
    (request(readonly=True), Status.INVALID_ARGUMENT, "set readOnly: false in the Pod's csi volume"),
    (request(access="block"), Status.INVALID_ARGUMENT, "must ask for a mount volume_capability"),
    (request(access=""), Status.INVALID_ARGUMENT, "got none"),
    # What the kubelet always sends, malformed
    (request(volume_id=""), Status.INVALID_ARGUMENT, "needs a volume_id"),
    (request(target_path=""), Status.INVALID_ARGUMENT, "needs a target_path"),
    (request(volume_context=context(**{POD_NAMESPACE_KEY: "ML"})), Status.INVALID_ARGUMENT,
     f"{POD_NAMESPACE_KEY} 'ML' is not a Kubernetes namespace name"),
    (request(volume_context=context(**{POD_NAME_KEY: "a/b"})), Status.INVALID_ARGUMENT, "is not a Kubernetes Pod name"),
    (request(uid="../../etc", target_path=target()), Status.INVALID_ARGUMENT, "'../../etc' is not a Pod uid"),
    (request(volume_context=context(**{SERVICE_ACCOUNT_KEY: "A B"})), Status.INVALID_ARGUMENT,
     "is not a service account name"),
    # Where the target may be
    (request(target_path="/mnt/elsewhere"), Status.INVALID_ARGUMENT,
     f"target_path /mnt/elsewhere is not in the kubelet's directory of Pod {UID} ({PODS}/{UID}/)"),
    (request(target_path=target(UID2)), Status.INVALID_ARGUMENT, "give the agent --kubelet-dir"),
    (request(target_path=f"{PODS}/{UID}/../{UID2}/volumes/x/mount"), Status.INVALID_ARGUMENT, "is not in the"),
    (request(target_path=f"{PODS}/{UID}"), Status.INVALID_ARGUMENT, "is not in the"),
])
def test_each_refusal_names_the_field_and_what_to_set(req: PublishRequest, status: Status, needle: str) -> None:
    with pytest.raises(Refused) as err:
        plan_publish({}, req, run_dir=RUN, kubelet_pods_dir=PODS)
    assert err.value.status is status
    assert needle in str(err.value)


def test_a_second_publish_of_the_same_volume_at_the_same_target_is_ok() -> None:
    book: dict[str, PodVolume] = {}
    first = publish(book, request())
    again = plan_publish(book, request(), run_dir=RUN, kubelet_pods_dir=PODS)
    assert again.already and again.volume == first


def test_a_volume_published_elsewhere_or_a_target_taken_is_already_exists() -> None:
    book: dict[str, PodVolume] = {}
    publish(book, request())
    for req, needle in [
        (request(target_path=target(volume="other")), f"already published at {target()}"),
        (request(volume_context=context(role="fill")), "for Pod ml/train-0"),
        (request(volume_id="csi-9999"), f"{target()} already holds volume csi-1f2e"),
    ]:
        with pytest.raises(Refused) as err:
            plan_publish(book, req, run_dir=RUN, kubelet_pods_dir=PODS)
        assert err.value.status is Status.ALREADY_EXISTS
        assert needle in str(err.value)


def test_a_pod_is_a_training_or_a_fill_pod_not_both() -> None:
    book: dict[str, PodVolume] = {}
    publish(book, request())
    same_role = publish(book, request("csi-2", target_path=target(volume="second")))
    assert same_role.directory == book["csi-1f2e"].directory
    with pytest.raises(Refused, match=r"give its csi\.bubbles\.dev volumes one role") as err:
        plan_publish(book, request("csi-3", target_path=target(volume="third"), volume_context=context(role="fill")),
                     run_dir=RUN, kubelet_pods_dir=PODS)
    assert err.value.status is Status.INVALID_ARGUMENT


def test_unpublish_undoes_the_mount_and_the_directory_goes_with_the_pods_last_volume() -> None:
    book: dict[str, PodVolume] = {}
    first = publish(book, request())
    publish(book, request("csi-2", target_path=target(volume="second")))
    plan = plan_unpublish(book, "csi-1f2e", target(), kubelet_pods_dir=PODS)
    assert (plan.volume, plan.target, plan.pod_dir) == (first, target(), None)  # the Pod's other volume still uses it
    del book["csi-1f2e"]
    plan = plan_unpublish(book, "csi-2", target(volume="second"), kubelet_pods_dir=PODS)
    assert plan.pod_dir == f"{RUN}/_pods/{UID}"


def test_unpublish_of_an_unknown_volume_is_ok_and_cleans_only_a_kubelet_target() -> None:
    book: dict[str, PodVolume] = {}
    publish(book, request())
    # Not in the book (an agent that lost its state): the target in the kubelet's Pods is still undone.
    assert plan_unpublish(book, "csi-gone", target(UID2), kubelet_pods_dir=PODS) == \
        plan_unpublish({}, "csi-gone", target(UID2), kubelet_pods_dir=PODS)
    plan = plan_unpublish(book, "csi-gone", target(UID2), kubelet_pods_dir=PODS)
    assert (plan.volume, plan.target, plan.pod_dir) == (None, target(UID2), None)
    # Outside the kubelet's Pods, or another volume's target: left alone.
    assert plan_unpublish(book, "csi-gone", "/etc", kubelet_pods_dir=PODS).target is None
    assert plan_unpublish(book, "csi-gone", target(), kubelet_pods_dir=PODS).target is None
    # A known volume is undone at its target even if the kubelet's directory moved since (--kubelet-dir changed).
    assert plan_unpublish(book, "csi-1f2e", target(), kubelet_pods_dir="/elsewhere").target == target()
    # A known volume asked at another target: not about it.
    plan = plan_unpublish(book, "csi-1f2e", target(volume="other"), kubelet_pods_dir=PODS)
    assert plan.volume is None and plan.pod_dir is None


@pytest.mark.parametrize(("volume_id", "target_path", "needle"), [
    ("", target(), "needs a volume_id"), ("csi-1", "", "needs a target_path")])
def test_unpublish_without_the_kubelets_fields_is_invalid(volume_id: str, target_path: str, needle: str) -> None:
    with pytest.raises(Refused, match=needle) as err:
        plan_unpublish({}, volume_id, target_path, kubelet_pods_dir=PODS)
    assert err.value.status is Status.INVALID_ARGUMENT


def test_the_book_survives_its_state_file() -> None:
    book: dict[str, PodVolume] = {}
    publish(book, request())
    publish(book, request("csi-2", uid=UID2, volume_context=context(UID2, role="fill")))
    assert book_from_json(book_to_json(book)) == book
    assert book_from_json(book_to_json({})) == {}


@pytest.mark.parametrize("text", ["", "[]", '{"version": 2, "volumes": []}', '{"version": 1}',
                                  '{"version": 1, "volumes": [{"volume_id": "x"}]}', "[" * 100000])
def test_an_unreadable_state_file_says_so(text: str) -> None:
    with pytest.raises(ValueError, match="unreadable"):
        book_from_json(text)


def test_a_record_with_a_role_unknown_is_unreadable() -> None:
    v = plan_publish({}, request(), run_dir=RUN, kubelet_pods_dir=PODS).volume
    text = book_to_json({v.volume_id: v}).replace('"training"', '"painter"')
    with pytest.raises(ValueError, match="unreadable"):
        book_from_json(text)


def test_the_decisions_and_the_configuration_load_no_grpc() -> None:
    """The pure part and the agent's configuration (which checks --kubelet-dir with bubbles.agent.csi) import neither
    gRPC nor the generated stubs: a fresh interpreter imports them and has none loaded."""
    import subprocess
    import sys

    code = ("import sys, bubbles.agent.csi.publish, bubbles.agent.config; "
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'bubbles.agent.csi.pb'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
