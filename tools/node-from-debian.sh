#!/usr/bin/env bash
# A real single-node Kubernetes cluster for the `cluster` test tier, from Debian's own packages only:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kubelet (1.20.2, built by
# tools/kube-from-debian.sh --node), containerd 1.6, runc and the CNI bridge plugin. No registry, no downloads
# beyond apt: images come from buildah on this machine (`import`).
#
#   kubeconfig=$(tools/node-from-debian.sh up)   # build or reuse the binaries, start everything, wait for Ready
#   tools/node-from-debian.sh import IMAGE...     # copy buildah images into the node's containerd
#   tools/node-from-debian.sh status              # which daemons run; the node
#   tools/node-from-debian.sh logs [NAME]         # the tail of each daemon's log (or one)
#   tools/node-from-debian.sh down                # stop it all, unmount, restore kernel settings, remove the state
#
# Env: BUBBLES_NODE_DIR  state, logs and kubeconfigs (default /tmp/bubbles-node)
#      BUBBLES_NODE_NAME the node's name (default bubbles-node)
# Needs root, cgroup v1 or hybrid (cgroupfs driver) and, the first time, about 10 minutes of 2 cores.
#
# What this VM needs, and why (each found the hard way; see also ../shared/NOTES.md where it exists):
# - containerd's CRI `restrict_oom_score_adj`: root here lacks CAP_SYS_RESOURCE, so runc cannot set the negative
#   oom_score_adj containerd gives sandboxes.
# - the API server prefers the node's InternalIP for kubelet calls (`kubectl logs`), as the node name does not resolve.
# - nothing may leave the machine: the kubelet's cloud probes are off (AWS_EC2_METADATA_DISABLED), Pods get a
#   resolv.conf naming 127.0.0.1 (an empty one makes containerd copy the host's), no NAT on the bridge.
# - no kube-proxy: Service IPs do not route. Pods that call the API server are told its address instead
#   (KUBERNETES_SERVICE_HOST/PORT; the chart's `extraEnv`), which is what clusters without kube-proxy do.
# - the kubelet's read-only port and iptables chains are off; image garbage collection is off (nothing can be
#   pulled again); the kernel settings it changes are saved on `up` and restored on `down`.
# - 1.20 refuses Pods until the namespace's default ServiceAccount has its token Secret: `up` waits for it.
set -euo pipefail
set +m

here=$(cd "$(dirname "$0")" && pwd)
STATE=${BUBBLES_NODE_DIR:-/tmp/bubbles-node}
NODE=${BUBBLES_NODE_NAME:-bubbles-node}
ETCD_PORT=22379      # not etcd's default ports: a system etcd or the api tier's etcd may be running
API_PORT=16443
SERVICES=10.96.0.0/24
PODS=10.244.0.0/24
BRIDGE=bubbles-br0
PAUSE=localhost/bubbles-pause:1.20.2
SOCK=$STATE/containerd.sock
DAEMONS=(containerd etcd kube-apiserver kube-controller-manager kube-scheduler kubelet)
TUNABLES=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys
          kernel.keys.root_maxbytes net.ipv4.ip_forward)
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}

say() { echo "node-from-debian: $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }
admin() { kubectl --kubeconfig "$STATE/admin.kubeconfig" "$@"; }
node_ip() { ip -4 -o addr show scope global | awk '{sub(/\/.*/, "", $4); print $4; exit}'; }

packages() {
  local want=(containerd runc containernetworking-plugins etcd-server openssl iproute2 buildah curl)
  command -v kubectl >/dev/null || want+=(kubernetes-client)  # any kubectl will do; some machines carry their own
  local missing=() p
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  say "apt-get install ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# -- daemons: one PID file each, "pid starttime", so a reused PID is never signalled ----------------------------------
started_at() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
pid_of() {
  local pid at
  [[ -f $STATE/pids/$1 ]] || return 1
  read -r pid at < "$STATE/pids/$1"
  [[ -n $pid && $(started_at "$pid") == "$at" ]] && echo "$pid"
}
alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{print $3}' "/proc/$1/stat") != Z ]]; }
launch() {  # NAME COMMAND...: detached (its own session), output in logs/NAME.log
  local name=$1; shift
  pid_of "$name" >/dev/null && return 0
  setsid "$@" > "$STATE/logs/$name.log" 2>&1 < /dev/null &
  echo "$! $(started_at $!)" > "$STATE/pids/$name"
}
halt() {  # NAME...: TERM, then KILL after 20 s
  local name pid pids=() i
  for name in "$@"; do
    if pid=$(pid_of "$name"); then kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
    rm -f "$STATE/pids/$name"
  done
  for ((i = 0; i < 100; i++)); do
    local left=0; for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    ((left)) || return 0
    sleep 0.2
  done
  for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null; done
  return 0
}
await() {  # SECONDS WHAT COMMAND...
  local limit=$1 deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "gave up after ${limit} s waiting for $what (logs: $STATE/logs)"
    sleep 0.5
  done
}

# -- certificates and configuration ------------------------------------------------------------------------------------
certificates() {
  local d=$STATE/pki ip=$1
  [[ -f $d/ready ]] && return 0
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=bubbles-node-ca \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  issue() {  # NAME SUBJECT [SANS]
    local ext="extendedKeyUsage=clientAuth,serverAuth"
    [[ -n ${3:-} ]] && ext+=$'\n'"subjectAltName=$3"
    openssl req -new -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
    openssl x509 -req -days 3650 -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
      -extfile <(printf '%s\n' "$ext") -out "$d/$1.crt" 2>/dev/null
    rm -f "$d/$1.csr"
  }
  issue apiserver /CN=kube-apiserver \
    "IP:127.0.0.1,IP:$ip,IP:${SERVICES%.0/*}.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  issue kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  issue admin "/O=system:masters/CN=bubbles-node-admin"
  issue controller-manager /CN=system:kube-controller-manager
  issue scheduler /CN=system:kube-scheduler
  issue kubelet "/O=system:nodes/CN=system:node:$NODE"  # the Node authorizer knows the kubelet by this name
  chmod 600 "$d"/*.key
  touch "$d/ready"
}

kubeconfig() {  # FILE CERT SERVER
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: node, cluster: {server: "$3", certificate-authority: "$STATE/pki/ca.crt"}}]
users: [{name: $2, user: {client-certificate: "$STATE/pki/$2.crt", client-key: "$STATE/pki/$2.key"}}]
contexts: [{name: node, context: {cluster: node, user: $2}}]
current-context: node
EOF
}

configure() {
  local ip=$1 server="https://$1:$API_PORT" c
  for c in admin controller-manager scheduler kubelet; do kubeconfig "$STATE/$c.kubeconfig" "$c" "$server"; done
  mkdir -p "$STATE/cni" "$STATE/ipam"
  cat > "$STATE/containerd.toml" <<EOF
version = 2
root = "$STATE/containerd/root"
state = "$STATE/containerd/state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$STATE/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
EOF
  cat > "$STATE/cni/10-bubbles.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "bubbles-node", "plugins": [{
  "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "$PODS"}]], "routes": [{"dst": "0.0.0.0/0"}],
           "dataDir": "$STATE/ipam"}}]}
EOF
  echo "nameserver 127.0.0.1" > "$STATE/resolv.conf"
  cat > "$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: "$STATE/pki/ca.crt"}}
authorization: {mode: Webhook}
readOnlyPort: 0
makeIPTablesUtilChains: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
clusterDomain: cluster.local
clusterDNS: ["127.0.0.1"]
resolvConf: "$STATE/resolv.conf"
EOF
}

# -- images ---------------------------------------------------------------------------------------------------------
import_images() {  # IMAGE...: buildah's images into the node's containerd (as docker archives)
  # Streamed, not written to a file first: the fill-job image is 1.3 GB, and the pipe let containerd unpack it while
  # buildah still wrote it (29 s against 37-45 s through a file, 2 runs each on the project's VM).
  local image
  for image in "$@"; do
    buildah push -q "$image" "docker-archive:/dev/stdout:$image" \
      | ctr --address "$SOCK" -n k8s.io images import - >/dev/null || fail "importing $image failed (buildah push | ctr import)"
    say "imported $image"
  done
}

pause_image() {  # the Pod sandbox image, from the static pause binary: no registry to pull it from
  buildah inspect --type image "$PAUSE" >/dev/null 2>&1 && return 0
  local c m
  c=$(buildah from scratch)
  m=$(buildah mount "$c")
  install -m 0755 "$BIN/pause" "$m/pause"
  buildah umount "$c" >/dev/null
  buildah config --entrypoint '["/pause"]' "$c"
  buildah commit -q "$c" "$PAUSE" >/dev/null
  buildah rm "$c" >/dev/null
}

# -- up / down ------------------------------------------------------------------------------------------------------
up() {
  [[ $(id -u) == 0 ]] || fail "needs root (containerd, the kubelet, mounts)"
  local t0=$SECONDS ip
  BIN=$("$here/kube-from-debian.sh" --node) || fail "no Kubernetes binaries (tools/kube-from-debian.sh --node)"
  packages
  ip=$(node_ip); [[ -n $ip ]] || fail "this machine has no global IPv4 address for the node"
  mkdir -p "$STATE"/{pids,logs}
  certificates "$ip"
  configure "$ip"
  if [[ ! -f $STATE/tunables ]]; then
    local t; for t in "${TUNABLES[@]}"; do echo "$t=$(sysctl -n "$t")"; done > "$STATE/tunables"
  fi
  # Paths the kubelet, containerd's shims and libcni use whatever their flags say: remember those made here.
  local d
  for d in /var/log/pods /var/log/containers /run/containerd /var/lib/kubelet /var/lib/cni; do
    [[ -d $d ]] || { mkdir -p "$d" && echo "$d" >> "$STATE/made"; }
  done

  launch containerd containerd --config "$STATE/containerd.toml"
  await 60 containerd ctr --address "$SOCK" version
  pause_image
  import_images "$PAUSE"

  launch etcd etcd --name node --data-dir "$STATE/etcd" --listen-metrics-urls "" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "node=http://127.0.0.1:$((ETCD_PORT + 1))"
  await 60 etcd curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

  local p=$STATE/pki
  # On the node's address (Pods reach it there); every request needs a client certificate or token.
  launch kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$ip" --advertise-address "$ip" --secure-port "$API_PORT" --anonymous-auth=false \
    --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" --client-ca-file "$p/ca.crt" \
    --kubelet-client-certificate "$p/kubelet-client.crt" --kubelet-client-key "$p/kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-signing-key-file "$p/sa.key" --service-account-key-file "$p/sa.pub" \
    --service-cluster-ip-range "$SERVICES" --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction --allow-privileged=true
  await 120 kube-apiserver admin get --raw /readyz

  launch kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --port 0 --secure-port 0 --leader-elect=false --use-service-account-credentials \
    --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
    --cluster-signing-cert-file "$p/ca.crt" --cluster-signing-key-file "$p/ca.key"
  launch kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig "$STATE/scheduler.kubeconfig" --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --port 0 --secure-port 0 --leader-elect=false
  # --keep-terminated-pod-volumes: a finished Pod's emptyDir stays until the Pod is deleted (by default the kubelet
  # tears a terminated Pod's volumes down), so that the tests read what a training wrote there (its losses) after it
  # ended; the trainings run in a baseline namespace, with no hostPath to write to.
  launch kubelet env AWS_EC2_METADATA_DISABLED=true "$BIN/kubelet" --config "$STATE/kubelet.yaml" \
    --kubeconfig "$STATE/kubelet.kubeconfig" --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" \
    --container-runtime remote --container-runtime-endpoint "unix://$SOCK" --image-service-endpoint "unix://$SOCK" \
    --pod-infra-container-image "$PAUSE" --hostname-override "$NODE" --node-ip "$ip" --keep-terminated-pod-volumes \
    --v 1

  await 120 "the node to register" admin get node "$NODE"
  await 180 "the node to be Ready" admin wait --for condition=Ready "node/$NODE" --timeout 5s
  await 120 "the default ServiceAccount's token" \
    bash -c "[[ -n \$(kubectl --kubeconfig '$STATE/admin.kubeconfig' -n default get sa default -o jsonpath='{.secrets[0].name}') ]]"
  say "node $NODE Ready at https://$ip:$API_PORT in $((SECONDS - t0)) s"
  echo "$STATE/admin.kubeconfig"
}

down() {
  [[ -d $STATE ]] || { say "nothing to stop ($STATE is absent)"; return 0; }
  halt kubelet
  if pid_of containerd >/dev/null; then  # the kubelet is gone: stop the Pods' containers ourselves
    local c ctr=(ctr --address "$SOCK" -n k8s.io)
    for c in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true; done
    sleep 1
    for c in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks delete -f "$c" >/dev/null 2>&1 || true; done
    for c in $("${ctr[@]}" containers ls -q 2>/dev/null); do
      rm -f /var/lib/cni/results/*-"$c"-*
      "${ctr[@]}" containers delete "$c" >/dev/null 2>&1 || true
    done
  fi
  halt kube-scheduler kube-controller-manager kube-apiserver etcd containerd
  # What a test started beside the node and a killed run left running (its Prometheus, which scrapes the node's Pods
  # and keeps its data in $STATE): every other process whose command line names this node's directory.
  local p
  for p in $(pgrep -f -- "$STATE/" || true); do
    [[ $p != "$$" ]] && kill -KILL "$p" 2>/dev/null || true
  done
  local m
  for m in $(awk -v s="$STATE/" 'index($5, s) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
  local g
  for g in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [[ -d $g ]] && find "$g" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  [[ -f $STATE/tunables ]] && { sysctl -q -p "$STATE/tunables" || true; }
  if [[ -f $STATE/made ]]; then
    local d
    while read -r d; do
      if [[ $d == /run/containerd ]]; then find "$d" -depth -type d -empty -delete 2>/dev/null || true; else rm -rf "$d"; fi
    done < "$STATE/made"
  fi
  rm -rf "$STATE"
  say "down: every daemon stopped, $STATE removed"
}

status() {
  local n rc=0 pid
  for n in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$n"); then echo "$n: running (pid $pid)"; else echo "$n: not running"; rc=1; fi
  done
  [[ -f $STATE/admin.kubeconfig ]] && admin get nodes -o wide 2>/dev/null || true
  return $rc
}

logs() {
  local n
  for n in "${@:-${DAEMONS[@]}}"; do
    [[ -f $STATE/logs/$n.log ]] || continue
    echo "----- $n (the last 40 lines of $STATE/logs/$n.log)"
    tail -n 40 "$STATE/logs/$n.log"
  done
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  logs) shift; logs "$@" ;;
  import) shift; (($#)) || fail "usage: $0 import IMAGE..."; import_images "$@" ;;
  *) echo "usage: $0 up|down|status|logs [NAME...]|import IMAGE..." >&2; exit 2 ;;
esac
