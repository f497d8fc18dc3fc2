#!/usr/bin/env bash
# Get a real Kubernetes API server for the tests, from Debian's own packages only (no registry here ships
# kube-apiserver, and there is no Docker engine for kind).
#
#   dir=$(tools/kube-from-debian.sh)          # prints a directory with kube-apiserver, etcd and kubectl
#   dir=$(tools/kube-from-debian.sh --node)   # ... and what a node needs besides: kubelet, kube-controller-manager,
#                                             # kube-scheduler and a static pause binary (tools/node-from-debian.sh)
#
# Order of preference: binaries already in $KUBEBUILDER_ASSETS; a cached build in $BUBBLES_KUBE_CACHE
# (default ~/.cache/bubbles/kube-1.20.2); else build kube-apiserver from Debian bookworm's `kubernetes` source
# package (1.20.2) with Debian's Go, and take etcd from `etcd-server` and kubectl from `kubernetes-client`.
# The first build needs root (apt-get) and about 10 minutes of 2 cores; later calls print the cache at once.
#
# One fix is needed to build 1.20 with the Go that bookworm ships (1.19): the vendored
# github.com/modern-go/reflect2 1.0.1 crashes at run time under Go >= 1.18, so it is replaced by Debian's
# packaged 1.0.2 (golang-github-modern-go-reflect2-dev) before building.
set -euo pipefail

node=0
case ${1:-} in
  --node) node=1 ;;
  "") ;;
  *) echo "usage: $0 [--node]" >&2; exit 2 ;;
esac
have() {
  [[ -x $1/kube-apiserver && -x $1/etcd && -x $1/kubectl ]] || return 1
  ((node == 0)) || [[ -x $1/kubelet && -x $1/kube-controller-manager && -x $1/kube-scheduler && -x $1/pause ]]
}

if [[ -n ${KUBEBUILDER_ASSETS:-} ]] && have "$KUBEBUILDER_ASSETS"; then
  echo "$KUBEBUILDER_ASSETS"; exit 0
fi
cache=${BUBBLES_KUBE_CACHE:-$HOME/.cache/bubbles/kube-1.20.2}
if have "$cache"; then
  echo "$cache"; exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "kube-from-debian: building kube-apiserver needs root for apt-get; run once as root or set KUBEBUILDER_ASSETS" >&2
  exit 1
fi
mkdir -p "$cache"
log=$cache/build.log
echo "kube-from-debian: building kube-apiserver, kubelet, kube-controller-manager and kube-scheduler 1.20.2 from" \
  "Debian's source package (about 10 minutes; log: $log)" >&2
(
  set -x
  if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
      > /etc/apt/sources.list.d/bubbles-debian-src.sources
  fi
  apt-get update -q
  # Any kubectl will do (some machines carry their own, which Debian's kubernetes-client would collide with).
  client=kubernetes-client
  command -v kubectl >/dev/null && client=
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    golang-go etcd-server $client rsync golang-github-modern-go-reflect2-dev dpkg-dev gcc libc6-dev
  src=$cache/src
  rm -rf "$src" && mkdir -p "$src" && cd "$src"
  apt-get source -q kubernetes
  cd kubernetes-*/
  reflect2=vendor/github.com/modern-go/reflect2
  rm -rf "$reflect2" && mkdir -p "$reflect2"
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s \
     "$reflect2"/
  rm -f "$reflect2"/*_test.go
  mkdir -p .go/src/k8s.io && ln -sfn ../../.. .go/src/k8s.io/kubernetes
  # All four in one `make` (they share most of the compile); static (CGO off), so nothing is needed at run time.
  env HOME="$cache/home" GOPATH="$PWD/.go" GOCACHE="$cache/gocache" CGO_ENABLED=0 \
    make WHAT="cmd/kube-apiserver cmd/kubelet cmd/kube-controller-manager cmd/kube-scheduler"
  for b in kube-apiserver kubelet kube-controller-manager kube-scheduler; do
    install -m 0755 "_output/bin/$b" "$cache/$b"
  done
  # The Pod sandbox process, from the same source tree, linked statically (a node has no registry to pull it from).
  gcc -Os -static -DVERSION=v1.20.2-debian -o "$cache/pause" build/pause/linux/pause.c && strip "$cache/pause"
  ln -sfn "$(command -v etcd)" "$cache/etcd"
  ln -sfn "$(command -v kubectl)" "$cache/kubectl"
  rm -rf "$src" "$cache/gocache" "$cache/home"
) > "$log" 2>&1 || { echo "kube-from-debian: build failed; the end of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
have "$cache" || { echo "kube-from-debian: build finished but binaries are missing in $cache" >&2; exit 1; }
echo "$cache"
