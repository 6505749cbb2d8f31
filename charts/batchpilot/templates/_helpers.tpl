{{/* The chart's name, and the release's full name (the release name when it already says batchpilot). */}}
{{- define "batchpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchpilot.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's resources: Deployment, Service, ServiceAccount, ClusterRole and binding. */}}
{{- define "batchpilot.operatorName" -}}
{{- printf "%s-operator" (include "batchpilot.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "batchpilot.labels" -}}
helm.sh/chart: {{ include "batchpilot.chart" . }}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchpilot
{{- end }}

{{- define "batchpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchpilot.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "batchpilot.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "batchpilot.peeringName" -}}
{{- default (include "batchpilot.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{/* A monitoring resource's namespace: its own setting, else the release's. */}}
{{- define "batchpilot.namespaceOf" -}}
{{- default .root.Release.Namespace .namespace }}
{{- end }}

{{/* The operator's rules, the same in the ClusterRole (every namespace) and in each Role
(operator.namespaces). Secrets: only `get`, only of the names repositoryCredentials.secretNames
lists (the Triton credential a policy names); never list or watch. */}}
{{- define "batchpilot.operatorRules" -}}
- apiGroups: [batchpilot.dev]
  resources: [batchpolicies]
  verbs: [get, list, watch, patch]
- apiGroups: [batchpilot.dev]
  resources: [batchpolicies/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- with .Values.repositoryCredentials.secretNames }}
- apiGroups: [""]
  resources: [secrets]
  resourceNames:
    {{- toYaml . | nindent 4 }}
  verbs: [get]
{{- end }}
{{- end }}

{{/*
The installed BatchPolicy CRD must be this chart's: helm installs crds/ once and never upgrades
them, and an operator over an older CRD would write fields the API server prunes. `lookup` finds
nothing under `helm template` and client-side dry runs, which skip the check.
*/}}
{{- define "batchpilot.crdCheck" -}}
{{- $crds := .Values.crds | default dict }}
{{- /* nil-safe: helm upgrade --reuse-values from a release before crds.check has no crds */}}
{{- if or (not (hasKey $crds "check")) $crds.check }}
{{- $wanted := (.Files.Get "crds/batchpolicy.yaml" | fromYaml).metadata.annotations }}
{{- $installed := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "batchpolicies.batchpilot.dev" }}
{{- if $installed }}
{{- $has := (($installed.metadata).annotations | default dict) }}
{{- $key := "batchpilot.dev/crd-revision" }}
{{- if ne (get $has $key) (get $wanted $key) }}
{{- fail (printf "the installed CRD batchpolicies.batchpilot.dev is revision %q, this chart's is %q: apply this release's CRDs first (kubectl apply --server-side --force-conflicts -f crds/), then run helm again; or set crds.check=false" (get $has $key | default "unknown") (get $wanted $key)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The sidecar image the webhook injects: versioned with the operator's (the appVersion). */}}
{{- define "batchpilot.sidecarImage" -}}
{{- if .Values.sidecar.image.digest }}
{{- printf "%s@%s" .Values.sidecar.image.repository .Values.sidecar.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) }}
{{- end }}
{{- end }}

{{/* The admission webhook's Service, Secret (its serving certificate) and configuration. */}}
{{- define "batchpilot.webhookName" -}}
{{- printf "%s-webhook" (include "batchpilot.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Where the webhook's certificate comes from: cert-manager or the chart (webhook.certificates.source). */}}
{{- define "batchpilot.webhookCertificateSource" -}}
{{- $source := .Values.webhook.certificates.source }}
{{- if eq $source "auto" }}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" }}cert-manager{{ else }}chart{{ end }}
{{- else }}
{{- $source }}
{{- end }}
{{- end }}

{{/* Whether to serve the webhook: "true" or "". An upgrade with --reuse-values from a chart
without it keeps the old values, which have no webhook or sidecar keys: it stays off then
(--reset-then-reuse-values takes this chart's defaults). */}}
{{- define "batchpilot.webhookEnabled" -}}
{{- if and (dig "webhook" "enabled" false .Values.AsMap) (dig "sidecar" "image" "repository" "" .Values.AsMap) }}true{{ end }}
{{- end }}
