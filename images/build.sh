#!/usr/bin/env bash
# Build an image from the repository root: [REGISTRY=host/path] images/build.sh operator|agent|fill-job [TAG]
# Uses docker, podman or buildah (whichever is on PATH). With OFFLINE=1 the wheels are downloaded here first
# (with the pinned constraints) into wheels/ of the build context and installed from there: for air-gapped
# builds, or builders whose TLS store cannot verify the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:?usage: images/build.sh operator|agent|fill-job [TAG]}"
# The default tag is the name the chart pulls: [$REGISTRY/]bubbles-<image>:<the chart's appVersion>.
version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' helm/bubbles/Chart.yaml)"
tag="${2:-${REGISTRY:+${REGISTRY}/}bubbles-${what}:${version:-dev}}"
[ -f "images/${what}/Dockerfile" ] || { echo "no images/${what}/Dockerfile" >&2; exit 2; }
[ "${PRINT_TAG:-0}" = 1 ] && { echo "$tag"; exit 0; }  # the name it would build, and nothing else
mkdir -p wheels
args=()
if [ "${OFFLINE:-0}" = 1 ]; then
  # One download serves all three images (their extras together) until the pins or the dependencies change:
  # resolving them against the index takes about 15 s even when every wheel is already here (empty wheels/ to
  # download again).
  stamp="wheels/.downloaded-$(cat constraints.txt pyproject.toml | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    rm -f wheels/.downloaded-*
    python3 -m pip download --quiet -c constraints.txt -d wheels ".[operator,agent]"
    python3 -m pip download --quiet -d wheels hatchling  # the build backend, for the offline wheel build
    touch "$stamp"
  fi
  args+=(--build-arg "PIP_ARGS=--no-index --find-links /src/wheels")
fi
[ -n "${BASE:-}" ] && args+=(--build-arg "BASE=${BASE}")
# The first engine that works here: docker only with a reachable daemon; podman and buildah need none.
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  exec docker build -f "images/${what}/Dockerfile" -t "$tag" "${args[@]}" .
elif command -v podman >/dev/null; then
  exec podman build -f "images/${what}/Dockerfile" -t "$tag" "${args[@]}" .
elif command -v buildah >/dev/null; then
  exec buildah bud --isolation chroot -f "images/${what}/Dockerfile" -t "$tag" "${args[@]}" .
fi
echo "images/build.sh: no container engine here (docker with a running daemon, podman or buildah)" >&2
exit 2
