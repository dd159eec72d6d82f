{{/* Names: the release's, unless it already says msd. */}}
{{- define "msd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "msd.labels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (list $ "coordinator"). */}}
{{- define "msd.selector" -}}
{{- $top := index . 0 -}}
app.kubernetes.io/name: {{ default $top.Chart.Name $top.Values.nameOverride }}
app.kubernetes.io/instance: {{ $top.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A container's security context: the values' one, and the pod security context's user, so that
a sidecar in a pod whose security context is not ours (a trainer's) runs as that user too. */}}
{{- define "msd.containerSecurity" -}}
{{- $pod := .Values.podSecurityContext -}}
{{- $runAs := dict -}}
{{- range $k := list "runAsNonRoot" "runAsUser" "runAsGroup" -}}
{{- if hasKey $pod $k -}}{{- $_ := set $runAs $k (get $pod $k) -}}{{- end -}}
{{- end -}}
{{- toYaml (merge $runAs .Values.securityContext) -}}
{{- end -}}

{{- define "msd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "msd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "msd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The coordinators, as every other pod reaches them: each pod of the StatefulSet by its stable
name under the headless Service (the namespace's search domain completes it), comma-separated
when there is a standby (workers, relays and ranks move to the one that serves). */}}
{{- define "msd.coordinatorAddress" -}}
{{- $name := printf "%s-coordinator" (include "msd.fullname" .) -}}
{{- $addresses := list -}}
{{- range $i := until (ternary 2 1 .Values.coordinator.standby) -}}
{{- $addresses = append $addresses (printf "tcp://%s-%d.%s:%d" $name $i $name (int $.Values.coordinator.port)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* The job file: the values' job text, as given (the order of its sources is their index, which a
mapping would lose), and security.curve pointing at the mounted keys when the keys come from a
Secret. */}}
{{- define "msd.jobFile" -}}
{{- $job := fromYaml .Values.job -}}
{{- if hasKey $job "Error" -}}
{{- fail (printf "job: not a YAML mapping: %s" (get $job "Error")) -}}
{{- end -}}
{{- if not (get $job "sources") -}}
{{- fail "job: the job file has no sources (docs/reference/job-file.md)" -}}
{{- end -}}
{{- .Values.job | trim -}}
{{- if .Values.security.curve.secretName -}}
{{- if hasKey $job "security" -}}
{{- fail "job: leave security out of the job file: with security.curve.secretName the chart sets security.curve to the mounted keys" -}}
{{- end }}
security:
  curve: /etc/msd/keys
{{- end -}}
{{- end -}}

{{/* Environment of every msd container: nothing is written outside the mounted volumes. */}}
{{- define "msd.env" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: MSD_CACHE_DIR
  value: /var/cache/msd
{{- end -}}

{{/* The Secret's files a role mounts at /etc/msd/keys: its own key pair, the public keys of the
servers it speaks to, and (for servers) the authorised clients' public keys. Call with
(list $ role volume-name): a trainer pod holds two, its relay's (trainer) and its worker
sidecar's (worker). */}}
{{- define "msd.keysVolume" -}}
{{- $top := index . 0 -}}
{{- $role := index . 1 -}}
{{- if $top.Values.security.curve.secretName }}
- name: {{ index . 2 }}
  secret:
    secretName: {{ $top.Values.security.curve.secretName }}
    defaultMode: 0440
    items:
      - {key: {{ $role }}.key, path: {{ $role }}.key}
      - {key: {{ $role }}.key_secret, path: {{ $role }}.key_secret}
      {{- if eq $role "coordinator" }}
      - {key: worker.key, path: authorized/worker.key}
      - {key: trainer.key, path: authorized/trainer.key}
      - {key: operator.key, path: authorized/operator.key}
      {{- else if eq $role "worker" }}
      - {key: coordinator.key, path: coordinator.key}
      - {key: trainer.key, path: trainer.key}
      {{- else if eq $role "trainer" }}
      - {key: coordinator.key, path: coordinator.key}
      - {key: worker.key, path: authorized/worker.key}
      {{- end }}
{{- end }}
{{- end -}}

{{/* Call with (list $ volume-name). */}}
{{- define "msd.keysMount" -}}
{{- if (index . 0).Values.security.curve.secretName }}
- name: {{ index . 1 }}
  mountPath: /etc/msd/keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "msd.dataVolume" -}}
{{- if .Values.data.volume }}
- name: data
  {{- toYaml .Values.data.volume | nindent 2 }}
{{- else if .Values.data.claimName }}
- name: data
  persistentVolumeClaim:
    claimName: {{ .Values.data.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "msd.dataMount" -}}
{{- if or .Values.data.volume .Values.data.claimName }}
- name: data
  mountPath: {{ .Values.data.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* A worker host agent's container: the Deployment's pods and the trainer pods' sidecar. Call
with (list $ maxProcs resources sidecar?). */}}
{{- define "msd.workerContainer" -}}
{{- $top := index . 0 -}}
{{- $sidecar := index . 3 -}}
- name: msd-worker
  image: {{ include "msd.image" $top }}
  imagePullPolicy: {{ $top.Values.image.pullPolicy }}
  {{- if $sidecar }}
  restartPolicy: Always
  {{- end }}
  command: ["msd"]
  args:
    - worker
    - --coordinator={{ include "msd.coordinatorAddress" $top }}
    {{- $procs := ternary "auto" $top.Values.workers.procs $sidecar }}
    - --procs={{ $procs }}
    {{- if eq (toString $procs) "auto" }}
    - --max-procs={{ index . 1 }}
    {{- end }}
    - --metrics-port={{ $top.Values.workers.metricsPort }}
    - --metrics-host=0.0.0.0
    - --log-format={{ $top.Values.logFormat }}
    {{- if $top.Values.security.curve.secretName }}
    - --keys=/etc/msd/keys
    {{- end }}
    {{- range $top.Values.workers.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "msd.env" $top | nindent 4 }}
  ports:
    - {name: worker-metrics, containerPort: {{ $top.Values.workers.metricsPort }}}
  livenessProbe:
    httpGet: {path: /healthz, port: worker-metrics}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 6
  readinessProbe:
    httpGet: {path: /readyz, port: worker-metrics}
    periodSeconds: 5
    timeoutSeconds: 5
  resources:
    {{- toYaml (index . 2) | nindent 4 }}
  securityContext:
    {{- include "msd.containerSecurity" $top | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: cache, mountPath: /var/cache/msd}
    {{- with include "msd.dataMount" $top }}{{ . | trim | nindent 4 }}{{- end }}
    {{- with include "msd.keysMount" (list $top (ternary "worker-keys" "keys" $sidecar)) }}{{ . | trim | nindent 4 }}{{- end }}
{{- end -}}

{{/* The relay sidecar of a trainer pod (a native sidecar: an init container that keeps running,
started before the trainer and stopped after it). Its ranks reach it at /run/msd/relay.sock. */}}
{{- define "msd.relayContainer" -}}
- name: msd-relay
  image: {{ include "msd.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  command: ["msd"]
  args:
    - relay
    - --coordinator=$(MSD_COORDINATOR)
    - --host=$(POD_IP)
    - --bind-host=0.0.0.0
    - --port={{ .Values.relay.port }}
    - --local=ipc:///run/msd/relay.sock
    {{- if .Values.security.curve.secretName }}
    - --keys=/etc/msd/keys
    {{- end }}
  env:
    {{- include "msd.env" . | nindent 4 }}
    - name: MSD_COORDINATOR
      value: {{ include "msd.coordinatorAddress" . | quote }}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
  ports:
    - {name: relay, containerPort: {{ .Values.relay.port }}}
  startupProbe:
    tcpSocket: {port: relay}
    periodSeconds: 2
    failureThreshold: 30
  livenessProbe:
    tcpSocket: {port: relay}
    periodSeconds: 10
  resources:
    {{- toYaml .Values.relay.resources | nindent 4 }}
  securityContext:
    {{- include "msd.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: msd-run, mountPath: /run/msd}
    {{- with include "msd.keysMount" (list . "keys") }}{{ . | trim | nindent 4 }}{{- end }}
{{- end -}}

{{/* A trainer pod's sidecars, volumes and the trainer container's environment and mounts. */}}
{{- define "msd.trainerSidecars" -}}
{{ include "msd.relayContainer" . }}
{{- if .Values.workers.sidecar.enabled }}
{{ include "msd.workerContainer" (list . .Values.workers.sidecar.maxProcs .Values.workers.sidecar.resources true) }}
{{- end }}
{{- end -}}

{{- define "msd.trainerVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: msd-run, emptyDir: {medium: Memory, sizeLimit: 64Mi}}
{{- if .Values.workers.sidecar.enabled }}
- {name: cache, emptyDir: {sizeLimit: {{ .Values.cache.sizeLimit }}}}
{{- include "msd.dataVolume" . }}
{{- end }}
{{- include "msd.keysVolume" (list . "trainer" "keys") }}
{{- if .Values.workers.sidecar.enabled }}
{{- include "msd.keysVolume" (list . "worker" "worker-keys") }}
{{- end }}
{{- with .Values.trainer.volumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "msd.trainerEnv" -}}
- name: MSD_COORDINATOR
  value: {{ include "msd.coordinatorAddress" . | quote }}
- name: MSD_RELAY
  value: ipc:///run/msd/relay.sock
- name: NNODES
  value: {{ .Values.trainer.nodes | quote }}
- name: NPROC_PER_NODE
  value: {{ .Values.trainer.procsPerNode | quote }}
{{- with .Values.trainer.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The trainer container: call with (list $ name extra-env-YAML). */}}
{{- define "msd.trainerContainer" -}}
- name: {{ index . 1 }}
  image: {{ required "trainer.image: the training image (with megascale-data's trainer client)" (index . 0).Values.trainer.image }}
  command: {{ toJson (index . 0).Values.trainer.command }}
  args: {{ toJson (index . 0).Values.trainer.args }}
  env:
    {{- include "msd.trainerEnv" (index . 0) | nindent 4 }}
    {{- with index . 2 }}
    {{- . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml (index . 0).Values.trainer.resources | nindent 4 }}
  volumeMounts:
    - {name: msd-run, mountPath: /run/msd}
    {{- with (index . 0).Values.trainer.volumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
