#!/usr/bin/env bash
# Regenerate the Python stubs from proto/ (grpcio-tools, pinned in constraints.txt).
# Usage: tools/gen-proto.sh [OUTPUT_ROOT]
#   default: each set where it is committed: the node agent API's under core/; the CSI node plugin's, the kubelet
#   plugin registration's, the kubelet device plugin API's and the kubelet PodResources API's under agent/ (only the
#   agent serves or calls them; the operator's image does without).
#   OUTPUT_ROOT: every set under that one directory (tests/test_agentapi.py, tests/test_csi_proto.py,
#   tests/test_device_plugin_proto.py and tests/test_podresources.py generate into a temporary directory and fail
#   when the committed stubs differ).
# proto/csi/ and proto/pluginregistration/ keep the paths of their upstream packages; protoc's VIRTUAL=DIR include maps
# them into bubbles.agent.csi.pb, so the generated modules import one another by that name and no top-level
# `csi` or `pluginregistration` module is made. The path changes nothing on the wire (package csi.v1 and
# pluginregistration, as the kubelet calls them).
set -euo pipefail
cd "$(dirname "$0")/.."
core_out="${1:-core}"
agent_out="${1:-agent}"
protoc() { "${PYTHON:-python3}" -m grpc_tools.protoc "$@"; }
protoc -Iproto --python_out="$core_out" --pyi_out="$core_out" --grpc_python_out="$core_out" \
  proto/bubbles/core/agentapi/v1alpha1/agent.proto
protoc -Ibubbles/agent/csi/pb=proto \
  --python_out="$agent_out" --pyi_out="$agent_out" --grpc_python_out="$agent_out" \
  bubbles/agent/csi/pb/csi/v1/csi.proto bubbles/agent/csi/pb/pluginregistration/v1/api.proto
# proto/deviceplugin/ keeps its upstream path; the include maps it into bubbles.agent.deviceplugin.pb, so no top-level
# `deviceplugin` module is made. Nothing changes on the wire (package v1beta1, as the kubelet calls it).
protoc -Ibubbles/agent/deviceplugin/pb=proto \
  --python_out="$agent_out" --pyi_out="$agent_out" --grpc_python_out="$agent_out" \
  bubbles/agent/deviceplugin/pb/deviceplugin/v1beta1/api.proto
# proto/podresources/ likewise keeps its upstream path, mapped into bubbles.agent.podresources.pb (package v1 on the
# wire, as the kubelet serves it).
protoc -Ibubbles/agent/podresources/pb=proto \
  --python_out="$agent_out" --pyi_out="$agent_out" --grpc_python_out="$agent_out" \
  bubbles/agent/podresources/pb/podresources/v1/api.proto
