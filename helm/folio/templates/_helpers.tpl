{{- define "folio.name" -}}{{ .Chart.Name }}{{- end -}}
{{- define "folio.fullname" -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}

{{- define "folio.labels" -}}
app.kubernetes.io/name: {{ include "folio.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "folio.headSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
folio.io/role: head
{{- end -}}

{{- define "folio.image" -}}{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}{{- end -}}

{{- define "folio.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{ printf "redis://%s-redis:6379/0" (include "folio.fullname" .) }}
{{- else -}}
{{ .Values.redis.url }}
{{- end -}}
{{- end -}}

{{- /* the Redis password's Secret: the given one, or (chart's Redis) one the chart generates */ -}}
{{- define "folio.redisSecretName" -}}
{{ .Values.redis.passwordSecret.name | default (printf "%s-redis" (include "folio.fullname" .)) }}
{{- end -}}

{{- define "folio.tensorParallelSize" -}}{{ .Values.workers.tensorParallelSize | default 1 }}{{- end -}}
{{- define "folio.numWorkers" -}}
{{- $tp := include "folio.tensorParallelSize" . | int -}}
{{- if mod (int .Values.workers.gpusPerPod) $tp -}}
{{- fail (printf "workers.tensorParallelSize (%d) must divide workers.gpusPerPod (%d): a worker's GPUs are on one pod" $tp (int .Values.workers.gpusPerPod)) -}}
{{- end -}}
{{ div (mul .Values.workers.replicas .Values.workers.gpusPerPod) $tp }}
{{- end -}}

{{/* The arguments of `folio serve` (tests parse them with the CLI's own parser). */}}
{{- define "folio.serveArgs" -}}
- --model
- {{ .Values.model.path | quote }}
- --num-workers
- {{ include "folio.numWorkers" . | quote }}
- --tensor-parallel-size
- {{ include "folio.tensorParallelSize" . | quote }}
- --address
- auto
- --redis-url
- {{ include "folio.redisUrl" . | quote }}
- --router
- {{ .Values.serve.router | quote }}
- --namespace
- {{ include "folio.fullname" . | quote }}
- --block-size
- {{ .Values.serve.blockSize | quote }}
{{- if .Values.serve.maxModelLen }}
- --max-model-len
- {{ .Values.serve.maxModelLen | quote }}
{{- end }}
- --max-num-seqs
- {{ .Values.serve.maxNumSeqs | quote }}
- --dtype
- {{ .Values.serve.dtype | quote }}
- --kv-cache-memory-gb
- {{ .Values.serve.kvCacheMemoryGb | quote }}
- --preemption-mode
- {{ .Values.serve.preemptionMode | quote }}
- --swap-space-gb
- {{ .Values.serve.swapSpaceGb | quote }}
- --kv-cache-layout
- {{ .Values.serve.kvCacheLayout | quote }}
- --grace-period-s
- {{ .Values.serve.gracePeriodSeconds | quote }}
- --host
- "0.0.0.0"
- --http-port
- {{ .Values.serve.httpPort | quote }}
- --grpc-port
- {{ .Values.serve.grpcPort | quote }}
- --metrics-port
- {{ .Values.serve.metricsPort | quote }}
- --max-num-requests
- {{ .Values.serve.maxNumRequests | quote }}
- --stream-interval
- {{ .Values.serve.streamInterval | quote }}
{{- if .Values.model.servedModelName }}
- --served-model-name
- {{ .Values.model.servedModelName | quote }}
{{- end }}
{{- end -}}

{{- define "folio.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit | default "50Gi" }}
{{- end }}
{{- end -}}

{{- define "folio.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
  readOnly: {{ ne .Values.model.source "download" }}
{{- end -}}

{{- define "folio.initContainers" -}}
{{- if eq .Values.model.source "download" }}
initContainers:
  - name: download-model
    image: {{ .Values.model.download.image }}
    command: {{ toJson .Values.model.download.command }}
    securityContext:
      runAsNonRoot: true
      runAsUser: 1000
      allowPrivilegeEscalation: false
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.path }}
{{- end }}
{{- end -}}

{{- define "folio.env" -}}
- name: RAY_AUTH_MODE
  value: disabled
# a call in flight on a dead worker fails at once instead of waiting 1-2 s for Ray's death reason
- name: RAY_timeout_ms_task_wait_for_death_info
  value: "0"
# a stopped process that Folio kills (a frozen worker or coordinator) gets SIGKILL after 1 s, not 5
- name: RAY_kill_worker_timeout_milliseconds
  value: "1000"
# a frontend replica failing its health checks is killed at once, not drained for the grace period
- name: RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS
  value: "1"
{{- if .Values.apiKey.enabled }}
- name: FOLIO_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "folio.fullname" .)) }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if or .Values.redis.enabled .Values.redis.passwordSecret.name }}
- name: FOLIO_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "folio.redisSecretName" . }}
      key: {{ .Values.redis.passwordSecret.key }}
{{- end }}
{{- end -}}

{{- /* a pod's security and termination; (dict "root" $ "head" true) on the head, which runs the frontends */ -}}
{{- define "folio.podSecurity" -}}
{{- $v := .root.Values -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 1000
  fsGroup: 1000
  {{- if and .head $v.serve.migrateQueuedConnections }}
  # a connection queued on a frontend replica that dies moves to another replica's socket
  # instead of being reset (an unsafe sysctl: the node's kubelet must allow it)
  sysctls:
    - {name: net.ipv4.tcp_migrate_req, value: "1"}
  {{- end }}
terminationGracePeriodSeconds: {{ add $v.serve.gracePeriodSeconds 15 }}
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{ toJson . }}
{{- end }}
{{- end -}}
