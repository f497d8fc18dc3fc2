#!/usr/bin/env bash
# Get a real Kubernetes API server for the tests, from Debian's own packages only (no registry here ships
# kube-apiserver, and there is no Docker engine for kind).
#
#   dir=$(tools/kube-from-debian.sh)      # prints a directory with kube-apiserver, etcd and kubectl
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

have() { [[ -x $1/kube-apiserver && -x $1/etcd && -x $1/kubectl ]]; }

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
echo "kube-from-debian: building kube-apiserver 1.20.2 from Debian's source package (about 10 minutes; log: $log)" >&2
(
  set -x
  if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
      > /etc/apt/sources.list.d/bubbles-debian-src.sources
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    golang-go etcd-server kubernetes-client rsync golang-github-modern-go-reflect2-dev dpkg-dev
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
  env HOME="$cache/home" GOPATH="$PWD/.go" GOCACHE="$cache/gocache" CGO_ENABLED=0 make WHAT=cmd/kube-apiserver
  install -m 0755 _output/bin/kube-apiserver "$cache/kube-apiserver"
  ln -sfn "$(command -v etcd)" "$cache/etcd"
  ln -sfn "$(command -v kubectl)" "$cache/kubectl"
  rm -rf "$src" "$cache/gocache" "$cache/home"
) > "$log" 2>&1 || { echo "kube-from-debian: build failed; the end of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
have "$cache" || { echo "kube-from-debian: build finished but binaries are missing in $cache" >&2; exit 1; }
echo "$cache"
