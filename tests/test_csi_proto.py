"""The CSI node plugin's protocols: the committed stubs are what tools/gen-proto.sh makes of proto/csi/ and
proto/pluginregistration/, and the subset of csi.proto keeps the CSI specification's names and field numbers, so the
kubelet's client (generated from the full csi.proto) and this plugin read each other's messages."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor, FileDescriptor

from bubbles.agent.csi.pb.csi.v1 import csi_pb2
from bubbles.agent.csi.pb.pluginregistration.v1 import api_pb2

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "agent" / "bubbles" / "agent" / "csi" / "pb"

# From csi.proto of CSI v1.12.0 (github.com/container-storage-interface/spec): every field, enum value and method of
# the messages and services the subset keeps, with its number (or its request -> response). Map entries left out.
SPEC = {
    "GetPluginInfoResponse.name": 1,
    "GetPluginInfoResponse.vendor_version": 2,
    "GetPluginInfoResponse.manifest": 3,
    "GetPluginCapabilitiesResponse.capabilities": 1,
    "PluginCapability.service": 1,
    "PluginCapability.volume_expansion": 2,
    "PluginCapability.Service.type": 1,
    "PluginCapability.Service.Type.UNKNOWN": 0,
    "PluginCapability.Service.Type.CONTROLLER_SERVICE": 1,
    "PluginCapability.Service.Type.VOLUME_ACCESSIBILITY_CONSTRAINTS": 2,
    "PluginCapability.Service.Type.GROUP_CONTROLLER_SERVICE": 3,
    "PluginCapability.Service.Type.SNAPSHOT_METADATA_SERVICE": 4,
    "PluginCapability.VolumeExpansion.type": 1,
    "PluginCapability.VolumeExpansion.Type.UNKNOWN": 0,
    "PluginCapability.VolumeExpansion.Type.ONLINE": 1,
    "PluginCapability.VolumeExpansion.Type.OFFLINE": 2,
    "ProbeResponse.ready": 1,
    "VolumeCapability.block": 1,
    "VolumeCapability.mount": 2,
    "VolumeCapability.access_mode": 3,
    "VolumeCapability.MountVolume.fs_type": 1,
    "VolumeCapability.MountVolume.mount_flags": 2,
    "VolumeCapability.MountVolume.volume_mount_group": 3,
    "VolumeCapability.AccessMode.mode": 1,
    "VolumeCapability.AccessMode.Mode.UNKNOWN": 0,
    "VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER": 1,
    "VolumeCapability.AccessMode.Mode.SINGLE_NODE_READER_ONLY": 2,
    "VolumeCapability.AccessMode.Mode.MULTI_NODE_READER_ONLY": 3,
    "VolumeCapability.AccessMode.Mode.MULTI_NODE_SINGLE_WRITER": 4,
    "VolumeCapability.AccessMode.Mode.MULTI_NODE_MULTI_WRITER": 5,
    "VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER": 6,
    "VolumeCapability.AccessMode.Mode.SINGLE_NODE_MULTI_WRITER": 7,
    "Topology.segments": 1,
    "NodePublishVolumeRequest.volume_id": 1,
    "NodePublishVolumeRequest.publish_context": 2,
    "NodePublishVolumeRequest.staging_target_path": 3,
    "NodePublishVolumeRequest.target_path": 4,
    "NodePublishVolumeRequest.volume_capability": 5,
    "NodePublishVolumeRequest.readonly": 6,
    "NodePublishVolumeRequest.secrets": 7,
    "NodePublishVolumeRequest.volume_context": 8,
    "NodeUnpublishVolumeRequest.volume_id": 1,
    "NodeUnpublishVolumeRequest.target_path": 2,
    "NodeGetCapabilitiesResponse.capabilities": 1,
    "NodeServiceCapability.rpc": 1,
    "NodeServiceCapability.RPC.type": 1,
    "NodeServiceCapability.RPC.Type.UNKNOWN": 0,
    "NodeServiceCapability.RPC.Type.STAGE_UNSTAGE_VOLUME": 1,
    "NodeServiceCapability.RPC.Type.GET_VOLUME_STATS": 2,
    "NodeServiceCapability.RPC.Type.EXPAND_VOLUME": 3,
    "NodeServiceCapability.RPC.Type.VOLUME_CONDITION": 4,
    "NodeServiceCapability.RPC.Type.SINGLE_NODE_MULTI_WRITER": 5,
    "NodeServiceCapability.RPC.Type.VOLUME_MOUNT_GROUP": 6,
    "NodeGetInfoResponse.node_id": 1,
    "NodeGetInfoResponse.max_volumes_per_node": 2,
    "NodeGetInfoResponse.accessible_topology": 3,
    "Identity.GetPluginInfo": "GetPluginInfoRequest -> GetPluginInfoResponse",
    "Identity.GetPluginCapabilities": "GetPluginCapabilitiesRequest -> GetPluginCapabilitiesResponse",
    "Identity.Probe": "ProbeRequest -> ProbeResponse",
    "Node.NodePublishVolume": "NodePublishVolumeRequest -> NodePublishVolumeResponse",
    "Node.NodeUnpublishVolume": "NodeUnpublishVolumeRequest -> NodeUnpublishVolumeResponse",
    "Node.NodeGetCapabilities": "NodeGetCapabilitiesRequest -> NodeGetCapabilitiesResponse",
    "Node.NodeGetInfo": "NodeGetInfoRequest -> NodeGetInfoResponse",
}

# From the kubelet's pluginregistration/v1/api.proto.
REGISTRATION = {
    "PluginInfo.type": 1,
    "PluginInfo.name": 2,
    "PluginInfo.endpoint": 3,
    "PluginInfo.supported_versions": 4,
    "RegistrationStatus.plugin_registered": 1,
    "RegistrationStatus.error": 2,
    "Registration.GetInfo": "InfoRequest -> PluginInfo",
    "Registration.NotifyRegistrationStatus": "RegistrationStatus -> RegistrationStatusResponse",
}


def test_the_committed_stubs_are_generated_from_the_protos(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "tools" / "gen-proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=120)
    fresh = tmp_path / "bubbles" / "agent" / "csi" / "pb"
    made = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file())
    assert made == ["csi/v1/csi_pb2.py", "csi/v1/csi_pb2.pyi", "csi/v1/csi_pb2_grpc.py",
                    "pluginregistration/v1/api_pb2.py", "pluginregistration/v1/api_pb2.pyi",
                    "pluginregistration/v1/api_pb2_grpc.py"]
    stale = [n for n in made if not filecmp.cmp(fresh / n, STUBS / n, shallow=False)]
    assert not stale, f"{stale} differ from the .proto: run tools/gen-proto.sh and commit the result"


def _numbers(file: FileDescriptor) -> dict[str, int | str]:
    package = file.package + "."
    out: dict[str, int | str] = {}

    def walk(d: Descriptor) -> None:
        if d.GetOptions().map_entry:
            return
        name = d.full_name.removeprefix(package)
        out.update({f"{name}.{f.name}": f.number for f in d.fields})
        for nested in d.nested_types:
            walk(nested)
        for enum in d.enum_types:
            out.update({f"{enum.full_name.removeprefix(package)}.{v.name}": v.number for v in enum.values})

    for message in file.message_types_by_name.values():
        walk(message)
    for service in file.services_by_name.values():
        for m in service.methods:
            out[f"{service.name}.{m.name}"] = (f"{m.input_type.full_name.removeprefix(package)} -> "
                                               f"{m.output_type.full_name.removeprefix(package)}")
    return out


def test_the_csi_subset_keeps_the_specifications_names_and_numbers() -> None:
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"  # the kubelet calls /csi.v1.Node/NodePublishVolume
    assert _numbers(csi_pb2.DESCRIPTOR) == SPEC


def test_the_registration_api_is_the_kubelets() -> None:
    assert api_pb2.DESCRIPTOR.package == "pluginregistration"  # /pluginregistration.Registration/GetInfo
    assert _numbers(api_pb2.DESCRIPTOR) == REGISTRATION


def test_a_kubelet_request_with_fields_the_subset_left_out_still_parses() -> None:
    # A newer kubelet may send fields this subset does not name: protobuf keeps them as unknown fields, and the known
    # ones read as sent.
    sent = csi_pb2.NodeGetInfoResponse(node_id="n").SerializeToString() + bytes([0x22, 0x01, 0x78])  # field 4: "x"
    got = csi_pb2.NodeGetInfoResponse.FromString(sent)
    assert got.node_id == "n"
