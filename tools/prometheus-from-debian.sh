#!/usr/bin/env bash
# Get a real Prometheus server for the dashboard tests, from Debian's own package.
#
#   bin=$(tools/prometheus-from-debian.sh)   # prints the path of a prometheus binary
#
# Order of preference: $BUBBLES_PROMETHEUS if it is an executable; `prometheus` on $PATH; else install Debian's
# `prometheus` package (needs root for apt-get). The package also enables a system service on :9090; the tests
# start their own server on a free loopback port with its own configuration and storage, so that service is
# stopped here (it would only use memory) where it was started by this install.
set -euo pipefail

if [[ -n ${BUBBLES_PROMETHEUS:-} && -x $BUBBLES_PROMETHEUS ]]; then
  echo "$BUBBLES_PROMETHEUS"; exit 0
fi
if bin=$(command -v prometheus); then
  echo "$bin"; exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "prometheus-from-debian: installing Debian's prometheus needs root for apt-get; run once as root or set" \
       "BUBBLES_PROMETHEUS to a prometheus binary" >&2
  exit 1
fi
log=${TMPDIR:-/tmp}/bubbles-prometheus-install.log
echo "prometheus-from-debian: installing Debian's prometheus package (log: $log)" >&2
(
  set -x
  apt-get update -q
  # No service start during the install where policy-rc.d is honoured; stop it afterwards where it is not.
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -q --no-install-recommends prometheus
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
  fi
  pkill -u prometheus -x prometheus || true  # the packaged service, started by invoke-rc.d where there is no systemd
) > "$log" 2>&1 || { echo "prometheus-from-debian: install failed; the end of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
bin=$(command -v prometheus) || { echo "prometheus-from-debian: installed, but no prometheus on PATH" >&2; exit 1; }
echo "$bin"
