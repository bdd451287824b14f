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

{{/* Operator image reference; the tag defaults to the chart's appVersion. */}}
{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
