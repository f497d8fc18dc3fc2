"""The kubelet's device plugin API as the agent speaks it: the committed stubs are what tools/gen-proto.sh makes of
proto/deviceplugin/, and the names and field numbers on the wire are the kubelet's (v1beta1, Kubernetes 1.28)."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from bubbles.agent.deviceplugin.pb.deviceplugin.v1beta1 import api_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "agent" / "bubbles" / "agent" / "deviceplugin" / "pb" / "deviceplugin" / "v1beta1"


def test_the_committed_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "tools" / "gen-proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=120)
    fresh = tmp_path / "bubbles" / "agent" / "deviceplugin" / "pb" / "deviceplugin" / "v1beta1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"]
    stale = [n for n in names if not filecmp.cmp(fresh / n, STUBS / n, shallow=False)]
    assert not stale, f"{stale} differ from the .proto: run tools/gen-proto.sh and commit the result"


def test_the_wire_names_and_numbers_are_the_kubelets() -> None:
    file = pb.DESCRIPTOR
    assert file.package == "v1beta1"
    assert [m.name for m in file.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
    assert [m.name for m in file.services_by_name["Registration"].methods] == ["Register"]

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(pb.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert numbers(pb.DevicePluginOptions) == {"pre_start_required": 1, "get_preferred_allocation_available": 2}
    assert numbers(pb.Device) == {"ID": 1, "health": 2}
    assert numbers(pb.ContainerAllocateResponse) == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4,
                                                     "cdi_devices": 5}
    assert numbers(pb.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert numbers(pb.CDIDevice) == {"name": 1}
    assert numbers(pb.ContainerPreferredAllocationRequest) == {"available_deviceIDs": 1, "must_include_deviceIDs": 2,
                                                               "allocation_size": 3}
    # An upstream Device with its topology (field 3: NUMA node 1) is read, and the field it does not know kept.
    upstream = bytes.fromhex("0a0141" "12074865616c746879" "1a040a020801")
    d = pb.Device.FromString(upstream)
    assert (d.ID, d.health) == ("A", "Healthy") and d.SerializeToString() == upstream
