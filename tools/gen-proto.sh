#!/usr/bin/env bash
# Regenerate the Python stubs from proto/ (grpcio-tools, pinned in constraints.txt).
# Usage: tools/gen-proto.sh [OUTPUT_ROOT]
#   default: each set where it is committed: the node agent API's under core/, the kubelet device plugin API's under
#   agent/ (only the agent serves it; the operator's image does without).
#   OUTPUT_ROOT: every set under that one directory (tests/test_agentapi.py and tests/test_device_plugin_proto.py
#   generate into a temporary directory and fail when the committed stubs differ).
set -euo pipefail
cd "$(dirname "$0")/.."
core_out="${1:-core}"
agent_out="${1:-agent}"
protoc() { "${PYTHON:-python3}" -m grpc_tools.protoc "$@"; }
protoc -Iproto --python_out="$core_out" --pyi_out="$core_out" --grpc_python_out="$core_out" \
  proto/bubbles/core/agentapi/v1alpha1/agent.proto
# proto/deviceplugin/ keeps its upstream path; the include maps it into bubbles.agent.deviceplugin.pb, so no top-level
# `deviceplugin` module is made. Nothing changes on the wire (package v1beta1, as the kubelet calls it).
protoc -Ibubbles/agent/deviceplugin/pb=proto \
  --python_out="$agent_out" --pyi_out="$agent_out" --grpc_python_out="$agent_out" \
  bubbles/agent/deviceplugin/pb/deviceplugin/v1beta1/api.proto
