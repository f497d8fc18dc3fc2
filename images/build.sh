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
case "$what" in operator) extra="[operator]";; agent) extra="[agent]";; *) extra="";; esac
mkdir -p wheels
args=()
if [ "${OFFLINE:-0}" = 1 ]; then
  python3 -m pip download --quiet -c constraints.txt -d wheels ".${extra}"
  python3 -m pip download --quiet -d wheels hatchling  # the build backend, for the offline wheel build
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
