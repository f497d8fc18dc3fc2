#!/usr/bin/env bash
# Regenerate the node agent API's Python stubs from proto/ (grpcio-tools, pinned in constraints.txt).
# Usage: tools/gen-proto.sh [OUTPUT_ROOT]   (default: core/, where the stubs are committed)
# tests/test_agentapi.py runs this into a temporary directory and fails when the committed stubs differ.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-core}"
"${PYTHON:-python3}" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/bubbles/core/agentapi/v1alpha1/agent.proto
