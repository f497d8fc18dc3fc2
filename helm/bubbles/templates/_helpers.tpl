{{/* The release's base name: the release name, or release-chart when the release name does not contain it. */}}
{{- define "bubbles.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bubbles.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "bubbles.selector" (list . "agent") */}}
{{- define "bubbles.selector" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ $ctx.Chart.Name }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* An image of the chart: include "bubbles.image" (list . "operator") */}}
{{- define "bubbles.image" -}}
{{- $ctx := index . 0 -}}
{{- printf "%s/bubbles-%s:%s" $ctx.Values.image.registry (index . 1) (default $ctx.Chart.AppVersion $ctx.Values.image.tag) -}}
{{- end -}}

{{- define "bubbles.operatorServiceAccount" -}}{{ include "bubbles.fullname" . }}-operator{{- end -}}
{{- define "bubbles.agentServiceAccount" -}}{{ include "bubbles.fullname" . }}-agent{{- end -}}
{{- define "bubbles.agentSecret" -}}{{ include "bubbles.fullname" . }}-agent-tls{{- end -}}
{{- define "bubbles.operatorSecret" -}}{{ include "bubbles.fullname" . }}-operator-tls{{- end -}}

{{/* Whether to render ServiceMonitors: the switch, or (auto) the Prometheus Operator's API on the cluster. */}}
{{- define "bubbles.serviceMonitors" -}}
{{- $on := .Values.metrics.serviceMonitor.enabled -}}
{{- if or (eq (toString $on) "true") (and (eq (toString $on) "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
true
{{- end -}}
{{- end -}}

{{/* Whether the agent serves the CSI node plugin: nodeAccess csi needs it; agent.csi.enabled asks for it anyway. */}}
{{- define "bubbles.servesCSI" -}}
{{- if or (eq .Values.nodeAccess "csi") .Values.agent.csi.enabled -}}true{{- end -}}
{{- end -}}

{{/* The device plugin's --gpu-strategy: auto is cdi where the kubelet passes CDI devices by default (1.29), else
volume-mounts. */}}
{{- define "bubbles.gpuStrategy" -}}
{{- $s := .Values.agent.devicePlugin.strategy -}}
{{- if eq $s "auto" -}}
{{- if semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version -}}cdi{{- else -}}volume-mounts{{- end -}}
{{- else -}}{{ $s }}{{- end -}}
{{- end -}}

{{/* The UID fill Pods run as with nodeAccess csi: operator.fillRunAsUser, else (MPS) the agents', else 65532. */}}
{{- define "bubbles.fillRunAsUser" -}}
{{- if not (kindIs "invalid" .Values.operator.fillRunAsUser) -}}{{ int .Values.operator.fillRunAsUser }}
{{- else if eq .Values.agent.isolation "mps" -}}{{ int .Values.agent.runAsUser }}
{{- else -}}65532{{- end -}}
{{- end -}}

{{/* Whether the agent's container starts as root and setpriv drops it to agent.runAsUser with the capabilities it
needs: the CSI node plugin's mounts, the device plugin's sockets in the kubelet's directory. */}}
{{- define "bubbles.dropsToAgentUser" -}}
{{- if and (or (include "bubbles.servesCSI" .) .Values.agent.devicePlugin.enabled) (ne (int .Values.agent.runAsUser) 0) -}}true{{- end -}}
{{- end -}}

{{/* Contradictory values: fail with what to change. */}}
{{- define "bubbles.validate" -}}
{{- if and (eq .Values.operator.fillGpuAccess "devicePlugin") (not .Values.agent.devicePlugin.enabled) -}}
{{- fail "operator.fillGpuAccess=devicePlugin with agent.devicePlugin.enabled=false: fill Pods request their GPU's resource (bubbles.dev/gpu-<index>) from the agents' device plugin, and no agent would serve it. Set agent.devicePlugin.enabled=true, or operator.fillGpuAccess=envvar." -}}
{{- end -}}
{{- if and (eq .Values.nodeAccess "hostPath") (not (kindIs "invalid" .Values.operator.fillRunAsUser)) -}}
{{- fail "operator.fillRunAsUser applies with nodeAccess=csi; with nodeAccess=hostPath fill Pods run as agent.runAsUser (the node's sockets are private to it). Leave operator.fillRunAsUser empty, or set nodeAccess=csi." -}}
{{- end -}}
{{- if and (eq .Values.nodeAccess "csi") (eq .Values.agent.isolation "mps") (not (kindIs "invalid" .Values.operator.fillRunAsUser)) -}}
{{- if ne (int .Values.operator.fillRunAsUser) (int .Values.agent.runAsUser) -}}
{{- fail (printf "operator.fillRunAsUser=%d with agent.isolation=mps and agent.runAsUser=%d: an MPS server serves one UID, the trainings' (agent.runAsUser), and fill Pods of another UID would wait for it forever. Leave operator.fillRunAsUser empty (it then follows agent.runAsUser), or set the two alike." (int .Values.operator.fillRunAsUser) (int .Values.agent.runAsUser)) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection) -}}
{{- fail (printf "operator.replicas is %d but operator.leaderElection is false: replicas would all act at once. Set operator.leaderElection=true, or operator.replicas=1." (int .Values.operator.replicas)) -}}
{{- end -}}
{{- if and (eq .Values.agent.isolation "mps") (eq (int .Values.agent.runAsUser) 0) -}}
{{- fail "agent.isolation=mps with agent.runAsUser=0: an MPS server serves one UID, and the trainings and fill Pods do not run as root. Set agent.runAsUser (and runAsGroup) to the UID your trainings run as." -}}
{{- end -}}
{{- if eq .Values.agent.isolation "mps" -}}
{{- $shm := .Values.agent.mps.shmDir -}}
{{- if or (ne (clean $shm) $shm) (hasPrefix "//" $shm) -}}
{{- fail (printf "agent.mps.shmDir %q: write it without '.' or '..' parts or repeated or trailing slashes (the API server refuses '..' in a hostPath)." $shm) -}}
{{- end -}}
{{- if lt (len (splitList "/" $shm)) 3 -}}
{{- fail (printf "agent.mps.shmDir %q must be a directory of its own, at least two levels deep (for example /dev/shm/bubbles-mps)." $shm) -}}
{{- end -}}
{{- if or (eq $shm "/dev/shm") (and (hasPrefix "/dev/" $shm) (not (hasPrefix "/dev/shm/" $shm))) (hasPrefix "/proc/" $shm) (hasPrefix "/sys/" $shm) -}}
{{- fail (printf "agent.mps.shmDir %q would share (and give the agent's UID) the node's own /dev/shm or system files: use a directory of its own, for example /dev/shm/bubbles-mps." $shm) -}}
{{- end -}}
{{- range $name, $other := dict "agent.runDir" .Values.agent.runDir "agent.mps.pipeDir" .Values.agent.mps.pipeDir -}}
{{- $o := clean $other -}}
{{- if or (eq $o $shm) (hasPrefix (printf "%s/" $o) $shm) (hasPrefix (printf "%s/" $shm) $o) -}}
{{- fail (printf "agent.mps.shmDir %q must be apart from %s %q (neither inside the other): the Pods mount both, and each must hold only its own files." $shm $name $other) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.agent.allowUnisolated (eq .Values.agent.isolation "none") -}}
{{- fail "agent.allowUnisolated=true with agent.isolation=none says the same thing twice and hides a mistake: choose isolation contexts or mps, or leave allowUnisolated false." -}}
{{- end -}}
{{- $ports := list (int .Values.agent.port) (int .Values.agent.healthPort) (int .Values.agent.metricsPort) -}}
{{- if ne (len (uniq $ports)) 3 -}}
{{- fail (printf "agent.port, agent.healthPort and agent.metricsPort must differ (got %v)" $ports) -}}
{{- end -}}
{{- if and (eq .Values.grpc.tls "certManager") (not (.Capabilities.APIVersions.Has "cert-manager.io/v1")) (not .Values.grpc.certManager.skipApiCheck) -}}
{{- fail "grpc.tls=certManager but the cert-manager.io/v1 API is not on this cluster: install cert-manager, or use grpc.tls=generate (set grpc.certManager.skipApiCheck=true to render anyway)." -}}
{{- end -}}
{{- end -}}

{{/*
The init container of the agent's and the MPS daemon's Pods: the kubelet creates the hostPaths as root; give them to
agent.runAsUser once (mode first: root without CAP_FOWNER cannot chmod what it no longer owns). On a restart they are
the user's already: nothing to do. The run directory (the agent's Pod only; the second argument); with MPS the pipe
directory (the daemon makes its control socket there) and the /dev/shm directory, private to the UID (mode 0700) as
the training's shared memory will be in it.
*/}}
{{- define "bubbles.ownDirsInit" -}}
{{- $root := index . 0 -}}
{{- $run := index . 1 -}}
{{- $mps := eq $root.Values.agent.isolation "mps" -}}
{{- if ne (int $root.Values.agent.runAsUser) 0 }}
initContainers:
  - name: own-dirs
    image: {{ include "bubbles.image" (list $root "agent") }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command: ["/opt/bubbles/bin/python", "-c", "import os, sys\nu, g = int(sys.argv[1]), int(sys.argv[2])\nfor a in sys.argv[3:]:\n    mode, d = a.split(':', 1)\n    s = os.stat(d)\n    if (s.st_uid, s.st_gid) != (u, g):\n        os.chmod(d, int(mode, 8))\n        os.chown(d, u, g)",
              {{ $root.Values.agent.runAsUser | quote }}, {{ $root.Values.agent.runAsGroup | quote }}
              {{- if $run }}, "755:/run/bubbles"{{ end }}
              {{- if $mps }}, {{ printf "755:%s" $root.Values.agent.mps.pipeDir | quote }}, "700:/dev/shm"{{ end }}]
    securityContext:
      runAsUser: 0
      runAsNonRoot: false
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: [ALL], add: [CHOWN]}
    resources: {requests: {cpu: 10m, memory: 16Mi}, limits: {memory: 64Mi}}
    volumeMounts:
      {{- if $run }}
      - {name: run, mountPath: /run/bubbles}
      {{- end }}
      {{- if $mps }}
      - {name: mps-pipe, mountPath: {{ $root.Values.agent.mps.pipeDir }}}
      - {name: mps-shm, mountPath: /dev/shm}
      {{- end }}
{{- end }}
{{- end -}}
