"""The device plugin's pure part (issue 36, step 1): the resources a node's GPUs make, every strategy's answer to
Allocate, the refusals; and its settings, refused with what to fix. No gRPC here (tests/test_device_plugin_kubelet.py
serves it to a stand-in kubelet)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bubbles.agent.config import ConfigError, load_settings
from bubbles.agent.deviceplugin import decide
from bubbles.agent.deviceplugin.decide import (
    AllocationRefused,
    ContainerAllocation,
    GpuStrategy,
    Mount,
    NodeGpu,
    allocate,
    gpus_from_devices,
    plan_resources,
    preferred_allocation,
    track_gpus,
)

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def test_each_gpu_is_a_resource_of_its_own_with_k_healthy_fill_slots() -> None:
    gpus = gpus_from_devices({B: "cuda:1", A: "cuda:0"})
    assert gpus == (NodeGpu(0, A), NodeGpu(1, B))
    served = plan_resources(gpus, 3)
    assert list(served) == ["bubbles.dev/gpu-0", "bubbles.dev/gpu-1"]
    gpu1 = served["bubbles.dev/gpu-1"]
    assert gpu1.endpoint == "bubbles-gpu-1.sock"
    assert gpu1.devices() == ((f"{B}::0", "Healthy"), (f"{B}::1", "Healthy"), (f"{B}::2", "Healthy"))
    assert all(len(d) <= 63 for d, _ in gpu1.devices())  # the kubelet's limit on a device ID
    assert plan_resources((), 4) == {}


@pytest.mark.parametrize(("devices", "needle"), [
    ({A: "cpu"}, "not cuda:N"),
    ({A: "cuda:0", B: "cuda:0"}, "are both cuda:0"),
])
def test_gpus_without_a_single_nvml_index_are_refused(devices: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        gpus_from_devices(devices)


def test_a_gpu_nvml_stops_answering_for_keeps_its_resource_with_unhealthy_slots() -> None:
    known = gpus_from_devices({A: "cuda:0", B: "cuda:1"})
    gone = track_gpus(known, {A: "cuda:0"})
    assert gone == (NodeGpu(0, A), NodeGpu(1, B, healthy=False))
    assert {h for _, h in plan_resources(gone, 2)["bubbles.dev/gpu-1"].devices()} == {"Unhealthy"}
    assert track_gpus(known, None) == (NodeGpu(0, A, False), NodeGpu(1, B, False))  # NVML failed: all unhealthy
    assert track_gpus(gone, {A: "cuda:0", B: "cuda:1"}) == known  # back
    assert track_gpus((), None) == ()  # never seen: nothing to advertise
    assert track_gpus(known, {A: "cuda:0", B: "cuda:1", "GPU-c": "cuda:2"})[-1] == NodeGpu(2, "GPU-c")


@pytest.mark.parametrize(("strategy", "answer"), [
    (GpuStrategy.CDI, ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": "void"},
                                          cdi_devices=(f"nvidia.com/gpu={B}",))),
    (GpuStrategy.CDI_ANNOTATIONS,
     ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": "void"},
                         annotations={"cdi.k8s.io/bubbles.dev_gpu-1": f"nvidia.com/gpu={B}"})),
    (GpuStrategy.VOLUME_MOUNTS, ContainerAllocation(
        envs={"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
        mounts=(Mount(f"/var/run/nvidia-container-devices/{B}", "/dev/null"),))),
    (GpuStrategy.ENVVAR, ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": B})),
])
def test_allocate_answers_exactly_the_resources_gpu_in_the_chosen_form(strategy: GpuStrategy,
                                                                       answer: ContainerAllocation) -> None:
    served = plan_resources(gpus_from_devices({A: "cuda:0", B: "cuda:1"}), 4)
    got = allocate(served, "bubbles.dev/gpu-1", [[f"{B}::2"], [f"{B}::0", f"{B}::3"]], strategy)
    assert got == (answer, answer)  # one per container; two slots of one GPU are still that one GPU


@pytest.mark.parametrize("strategy", list(GpuStrategy))
def test_an_images_own_nvidia_visible_devices_all_never_shows_every_gpu(strategy: GpuStrategy) -> None:
    """CUDA base images set NVIDIA_VISIBLE_DEVICES=all; the kubelet's variables override the image's. Under the CDI
    forms the answer sets it to void (the NVIDIA runtime, where it still reads it, then adds no GPU beside the one CDI
    injects), under the others to the resource's GPU alone. A gang's container holds two resources: the kubelet
    merges their variables, which must then agree (they do, except under envvar: one variable cannot name two GPUs
    from two answers; gangs need another strategy, docs/platforms.md)."""
    served = plan_resources(gpus_from_devices({A: "cuda:0", B: "cuda:1"}), 4)
    image = {"NVIDIA_VISIBLE_DEVICES": "all"}
    merged = dict(image)
    answers = [allocate(served, f"bubbles.dev/gpu-{i}", [[f"{u}::0"]], strategy)[0] for i, u in enumerate((A, B))]
    for a in answers:
        merged.update(a.envs)  # the kubelet's order: the image's ENV, then each resource's answer
    seen = merged["NVIDIA_VISIBLE_DEVICES"]
    assert seen != "all"
    if strategy in (GpuStrategy.CDI, GpuStrategy.CDI_ANNOTATIONS):
        assert seen == "void" and all(a.envs == {"NVIDIA_VISIBLE_DEVICES": "void"} for a in answers)
    if strategy is GpuStrategy.ENVVAR:
        assert [a.envs["NVIDIA_VISIBLE_DEVICES"] for a in answers] == [A, B]  # the two disagree: the last wins
    else:
        assert len({a.envs["NVIDIA_VISIBLE_DEVICES"] for a in answers}) == 1


def test_the_cdi_annotation_key_is_one_the_cdi_library_accepts() -> None:
    # container-device-interface's AnnotationKey: "<plugin>_<device>" at most 63 characters, alphanumeric at both
    # ends, only alphanumerics, '_', '-' and '.' between.
    got = allocate(plan_resources([NodeGpu(127, A)], 1), "bubbles.dev/gpu-127", [[f"{A}::0"]],
                   GpuStrategy.CDI_ANNOTATIONS)
    (key,) = got[0].annotations
    name = key.removeprefix("cdi.k8s.io/")
    assert key.startswith("cdi.k8s.io/") and len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert all(c.isalnum() or c in "_-." for c in name)


@pytest.mark.parametrize(("resource", "containers", "code", "needle"), [
    ("nvidia.com/gpu", [[f"{A}::0"]], "NOT_FOUND", "resource 'nvidia.com/gpu' is not served on this node (served: "
                                                   "bubbles.dev/gpu-0, bubbles.dev/gpu-1)"),
    ("bubbles.dev/gpu-7", [[f"{A}::0"]], "NOT_FOUND", "not served on this node"),
    ("bubbles.dev/gpu-0", [[f"{A}::4"]], "INVALID_ARGUMENT", f"bubbles.dev/gpu-0 has no device {A}::4 (it advertises "
                                                             f"4 slots of GPU {A})"),
    ("bubbles.dev/gpu-0", [[f"{B}::0"]], "INVALID_ARGUMENT", f"has no device {B}::0"),  # another GPU's slot
    ("bubbles.dev/gpu-0", [[]], "INVALID_ARGUMENT", "names no device"),
])
def test_allocate_refuses_what_it_did_not_advertise(resource: str, containers: list[list[str]], code: str,
                                                     needle: str) -> None:
    served = plan_resources(gpus_from_devices({A: "cuda:0", B: "cuda:1"}), 4)
    with pytest.raises(AllocationRefused, match="bubbles device plugin") as err:
        allocate(served, resource, containers, GpuStrategy.CDI)
    assert err.value.code == code and needle in str(err.value)


def test_allocate_refuses_an_unhealthy_gpu_saying_it_can_be_placed_again() -> None:
    served = plan_resources([NodeGpu(0, A, healthy=False)], 2)
    with pytest.raises(AllocationRefused, match="is unhealthy") as err:
        allocate(served, "bubbles.dev/gpu-0", [[f"{A}::0"]], GpuStrategy.ENVVAR)
    assert err.value.code == "FAILED_PRECONDITION"
    assert not served["bubbles.dev/gpu-0"].gpu.healthy


def test_preferred_allocation_keeps_the_required_slots_then_the_lowest() -> None:
    slots = [f"{A}::{k}" for k in (10, 2, 0, 1)]
    assert preferred_allocation(slots, [f"{A}::10"], 2) == (f"{A}::10", f"{A}::0")
    assert preferred_allocation(slots, [], 3) == (f"{A}::0", f"{A}::1", f"{A}::2")
    assert preferred_allocation(slots[:1], [], 3) == (f"{A}::10",)
    assert not decide.OPTIONS.get_preferred_allocation_available
    assert decide.OPTIONS.pre_start_required  # the guard: tests/test_device_plugin_guard.py


def _files(tmp_path: Path) -> dict[str, Any]:
    for name in ("tls.crt", "tls.key", "token"):
        (tmp_path / name).write_text("x" * 32)
    return {"run_dir": tmp_path, "cluster": True, "node": "n", "tls_cert": tmp_path / "tls.crt",
            "tls_key": tmp_path / "tls.key", "token_file": tmp_path / "token"}


def test_the_device_plugin_is_off_by_default_and_set_from_every_source(tmp_path: Path) -> None:
    base = _files(tmp_path)
    cluster = load_settings(base, {}).cluster
    assert cluster is not None and cluster.device_plugin is None
    on = load_settings({**base, "device_plugin": True}, {}).cluster
    assert on is not None and on.device_plugin is not None
    assert (on.device_plugin.strategy, on.device_plugin.fill_slots, on.device_plugin.directory) == (
        GpuStrategy.CDI, 4, Path("/var/lib/kubelet/device-plugins"))
    assert on.device_plugin.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    f = tmp_path / "agent.yaml"
    f.write_text("device_plugin: true\ngpu_strategy: volume-mounts\nfill_slots: 2\n")
    env = {"BUBBLES_AGENT_FILL_SLOTS": "8", "BUBBLES_AGENT_DEVICE_PLUGIN_DIR": str(tmp_path)}
    got = load_settings(base, env, f).cluster
    assert got is not None and got.device_plugin is not None
    assert (got.device_plugin.strategy, got.device_plugin.fill_slots, got.device_plugin.directory) == (
        GpuStrategy.VOLUME_MOUNTS, 8, tmp_path)
    # Beside the device-plugins directory unless given: both are under the kubelet's --root-dir.
    assert got.device_plugin.pod_resources_socket == tmp_path.parent / "pod-resources" / "kubelet.sock"
    given = load_settings({**base, "pod_resources_socket": Path("/k/pod-resources/kubelet.sock")}, env, f).cluster
    assert given is not None and given.device_plugin is not None
    assert given.device_plugin.pod_resources_socket == Path("/k/pod-resources/kubelet.sock")


@pytest.mark.parametrize(("flags", "env", "needle"), [
    ({"device_plugin": True, "cluster": None}, {}, "--device-plugin only applies with --cluster"),
    ({"gpu_strategy": "envvar"}, {}, "--gpu-strategy only apply with --device-plugin"),
    ({"fill_slots": 2, "device_plugin_dir": Path("/x")}, {},
     "--fill-slots, --device-plugin-dir only apply with --device-plugin"),
    ({"device_plugin": True, "gpu_strategy": "nvlink"}, {},
     "--gpu-strategy must be one of cdi, cdi-annotations, volume-mounts, envvar"),
    ({"device_plugin": True, "fill_slots": 0}, {}, "--fill-slots must be a whole number from 1 to 64"),
    ({"device_plugin": True, "fill_slots": 65}, {}, "--fill-slots must be a whole number from 1 to 64"),
    ({"device_plugin": True}, {"BUBBLES_AGENT_FILL_SLOTS": "four"}, "--fill-slots from $BUBBLES_AGENT_FILL_SLOTS"),
    ({"device_plugin": True, "device_plugin_dir": Path("plugins")}, {}, "--device-plugin-dir must be an absolute"),
    ({"pod_resources_socket": Path("/k/kubelet.sock")}, {}, "--pod-resources-socket only apply with --device-plugin"),
    ({"device_plugin": True, "pod_resources_socket": Path("kubelet.sock")}, {},
     "--pod-resources-socket must be an absolute path written plainly (the kubelet's <root-dir>/pod-resources/"),
    ({"device_plugin": True}, {"BUBBLES_AGENT_POD_RESOURCES_SOCKET": "/k/../kubelet.sock"},
     "--pod-resources-socket must be an absolute path written plainly"),
    ({"device_plugin": True, "pod_resources_socket": Path("/" + "p" * 110)}, {},
     "longer than the 107 a Unix socket allows: mount the kubelet's pod-resources directory at a shorter path"),
    ({"device_plugin": True, "pod_resources_socket": Path("/tmp")}, {},
     "--pod-resources-socket /tmp is a directory: give the socket in it (/tmp/kubelet.sock)"),
    ({}, {"BUBBLES_AGENT_DEVICE_PLUGIN": "perhaps"}, "--device-plugin from $BUBBLES_AGENT_DEVICE_PLUGIN: expected"),
])
def test_bad_device_plugin_settings_say_what_to_fix(tmp_path: Path, flags: dict[str, Any], env: dict[str, str],
                                                    needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({**_files(tmp_path), **flags}, env)
    assert needle in str(err.value)


@pytest.mark.parametrize(("args", "needle"), [
    (["--gpu-strategy", "nvlink"], "argument --gpu-strategy: invalid choice: 'nvlink'"),
    (["--fill-slots", "3"], "--fill-slots only apply with --device-plugin"),
    (["--device-plugin"], "--device-plugin only applies with --cluster"),
    (["--pod-resources-socket", "/k/kubelet.sock"], "--pod-resources-socket only apply with --device-plugin"),
])
def test_the_cli_refuses_bad_device_plugin_flags_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             args: list[str], needle: str) -> None:
    from bubbles.cli import main

    try:
        code = main(["agent", "--run-dir", str(tmp_path), *args])
    except SystemExit as exc:  # argparse rejects a choice it parses itself
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
