{{/* Chart name, overridable with .Values.nameOverride. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource-name prefix: the release name, plus the chart name unless already in it. */}}
{{- define "baton.fullname" -}}
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

{{/* Name of the operator's Deployment, ClusterRole and ClusterRoleBinding. */}}
{{- define "baton.operatorName" -}}
{{- printf "%s-operator" (include "baton.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart renders. */}}
{{- define "baton.commonLabels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: baton
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Operator selector labels: immutable once the Deployment exists, so minimal. */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on the operator's objects. */}}
{{- define "baton.labels" -}}
{{ include "baton.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* ServiceAccount the operator runs as. */}}
{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "baton.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference; the tag defaults to the chart's appVersion (a number is fine). */}}
{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}

{{/* The one namespace the operator watches; empty for all namespaces. */}}
{{- define "baton.watchNamespace" -}}
{{- if .Values.watchNamespace }}{{ .Values.watchNamespace }}
{{- else if .Values.rbac.namespaced }}{{ .Release.Namespace }}
{{- end }}
{{- end }}

{{/* RBAC rules: exactly the requests the operator sends (tests/operator/test_operator_rbac.py
     records them against this list). Cluster-wide, kopf also watches CRDs. */}}
{{- define "baton.rbacRules" -}}
# The custom resource: kopf lists, watches and patches it (finalizer, annotations); the
# operator reads it and patches its status.
- apiGroups: [baton.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [baton.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need this where that admission plugin is on.
- apiGroups: [baton.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# The children: written and watched (drift is restored within seconds). Deployments and
# Services go with their service (garbage collection); the optional kinds are deleted when
# the spec drops them (the router's ServiceAccount, Role and RoleBinding exist only with
# spec.router.discovery: kubernetes). ScaledObjects and PodMonitors only where KEDA and the
# Prometheus operator are installed (the operator asks the API's discovery, which needs no
# rule); a PodMonitor goes with its service, as Deployments do.
{{- range list (list "apps" "deployments") (list "" "services") (list "monitoring.coreos.com" "podmonitors") }}
- apiGroups: [{{ index . 0 | quote }}]
  resources: [{{ index . 1 }}]
  verbs: [get, list, watch, create, patch]
{{- end }}
{{- range list (list "networking.k8s.io" "ingresses") (list "keda.sh" "scaledobjects") (list "networking.k8s.io" "networkpolicies") (list "autoscaling" "horizontalpodautoscalers") (list "policy" "poddisruptionbudgets") (list "" "serviceaccounts") (list "rbac.authorization.k8s.io" "roles") (list "rbac.authorization.k8s.io" "rolebindings") }}
- apiGroups: [{{ index . 0 | quote }}]
  resources: [{{ index . 1 }}]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}
# Each service's cluster key: made once (never rewritten, never read back in bulk: no list or
# watch of Secrets); the garbage collector deletes it with its service.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# The operator lists and watches its workers' pods for a refused model (ModelNotServable);
# the router's Role (spec.router.discovery: kubernetes) grants all three, and RBAC lets only a
# holder grant a permission (no `escalate`/`bind` needed).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Kubernetes Events about the services.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if not (include "baton.watchNamespace" .) }}
# kopf notices CRDs created or changed while it runs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
{{- end }}
