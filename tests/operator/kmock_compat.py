"""An emulated Kubernetes API for the operator tests: kmock 0.8 plus what `kopf run` and
`kubectl` need from a real API server (../shared/ENVIRONMENT.md lists the gaps).

On top of `kmock.KubernetesEmulator` this adds:
- object bookkeeping: uid, resourceVersion, generation (bumped on spec changes),
  creationTimestamp, generateName;
- PATCH as the API server does it: JSON patch (a failed `test` is 422), merge patch, strategic
  merge patch (kmock_patch), the `status` subresource (status-only) vs. the main resource
  (status ignored), the `scale` subresource of Deployments (an autoscaling/v1 Scale, as
  `kubectl scale` uses it), optimistic concurrency on metadata.resourceVersion, and no-op
  patches that change nothing at all;
- writes the API server refuses (kmock_admission): int32 overflows (400), invalid Ingress
  hosts and names (422), and admission policies installed by a test (422);
- authentication by bearer token and RBAC from the stored Roles and bindings (kmock_rbac);
- server-side printing: `kubectl get` of a custom resource gets a Table with the CRD's
  printer columns, lists, single objects and watches alike (kmock_table);
- CRDs created through the API register their resource for discovery (subresources without
  the short names, so kubectl does not warn about ambiguous short names); a group's preferred
  version is its most stable, newest one, not a random one;
- watches that honour ?resourceVersion and lose no event between snapshot and stream, sent
  as application/json; lists with kind, apiVersion and a resourceVersion; core discovery
  with groupVersion "v1";
- owner-reference garbage collection (immediate) like kube-controller-manager;
- injected faults (503 for the next N requests of a method on a resource);
- /api/v1/namespaces parsed as the cluster-scoped resource it is (kopf's namespace scanning).
Still absent: label/field selectors, PUT, OpenAPI schema validation and defaulting, CEL
validation rules, protobuf.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
import kmock_admission as admission
import kmock_rbac as rbac
import kmock_table
from kmock._internal import enums, parsing
from kmock_patch import merge_patch, strategic_merge_patch

_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads /api/v1/namespaces[/NAME[/status|finalize]] as a namespace scope (and
    crashes on the bare list); the API server means the cluster-scoped `namespaces` there."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))):
        return parsing.ParsedPath(group="", version="v1", plural="namespaces",
                                  name=parts[3] if len(parts) > 3 else None,
                                  subresource=parts[4] if len(parts) > 4 else None)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # kmock's request parser looks it up on the module
CRD = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
ALL_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
RBAC_PLURALS = ("roles", "clusterroles", "rolebindings", "clusterrolebindings")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Emulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self.faults: dict[tuple[str, str], int] = {}  # (method, plural) -> failures left
        self.policies: list[admission.Policy] = []
        self.audit: list[tuple[str, rbac.Attributes, bool]] = []  # RBAC-checked requests
        self.printer_columns: dict[kmock.resource, list[dict[str, Any]]] = {}
        self.schemas: dict[kmock.resource, dict[str, Any]] = {}  # of custom resources
        # client-go (kubectl -w, --wait) rejects kmock's application/octet-stream watches.
        (self.fallback ** 1)[enums.action.WATCH] << kmock.headers(
            {"Content-Type": "application/json"}) << self._serve_watch

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        self._authorize(request)
        fault = (request.method.value, str(request.resource.plural))
        if self.faults.get(fault, 0) > 0:
            self.faults[fault] -= 1
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                        message="injected fault", details={})
        if request.subresource == "scale":
            return await self._scale(request)
        if request.action == enums.action.UPDATE and request.name is not None:
            return await self._patch(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            self._stamp_new(request)
            self._admit(request.resource, request.data)
        response = await super()._handle(request)
        if response.status < 300 and request.action == enums.action.CREATE:
            if not response.prepared:
                response.set_status(201)  # Created, as clients generated from the OpenAPI expect
            if request.resource == CRD:
                self._register_crd(request.data)
        if response.status < 300 and request.action == enums.action.DELETE:
            await self._collect_garbage()
        return response

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        """kmock puts a formatted traceback into every error's details, which made a 404 three
        times slower than a GET; an API server's Status carries none."""
        if isinstance(exc, kmock.KubernetesError):
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": exc.status, "reason": exc.reason or type(exc).__name__,
                "message": exc.message or repr(exc), "details": exc.details or {}},
                status=exc.status)
        return await super()._render_error(exc)

    # -- authentication, authorization, admission ----------------------------------------------

    def _authorize(self, request: kmock.Request) -> None:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        identity = rbac.Identity.from_token(token, request.headers.get("Impersonate-User", ""))
        assert request.resource is not None
        if identity.admin or request.resource.plural is None:  # discovery is open to all
            return
        resource = str(request.resource.plural)
        attrs = rbac.Attributes(
            verb=rbac.verb(request.method.value, request.name is not None,
                           request.params.get("watch") in ("true", "1")),
            group=str(request.resource.group or ""),
            resource=f"{resource}/{request.subresource}" if request.subresource else resource,
            namespace=request.namespace, name=request.name)
        stored = {plural: [obj.raw for (res, _, _), obj in self.objects.items()
                           if res.group == rbac.RBAC and res.plural == plural and not obj.deleted]
                  for plural in RBAC_PLURALS}
        allowed = rbac.allowed(identity, attrs, stored)
        self.audit.append((identity.user, attrs, allowed))
        if not allowed:
            raise kmock.KubernetesError(status=403, reason="Forbidden",
                                        message=attrs.describe(identity.user), details={})

    def _admit(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        if resource in self.schemas:
            admission.apply_defaults(obj, self.schemas[resource])
        try:
            admission.check(str(resource.plural), obj, self.policies)
        except admission.Rejected as e:
            raise kmock.KubernetesError(status=e.status, reason=e.reason, message=e.message,
                                        details={}) from e

    # -- writes ------------------------------------------------------------------------------

    def _stamp_new(self, request: kmock.Request) -> None:
        body = request.data
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_version(), generation=1,
                    creationTimestamp=_now())
        resource, info = request.resource, self._resource_info(request.resource)
        if info.kind:  # the API server always stores (and returns) apiVersion and kind
            body.setdefault("apiVersion", f"{resource.group}/{resource.version}".lstrip("/"))
            body.setdefault("kind", info.kind)
        if "status" in self._resource_info(request.resource).subresources:
            body.pop("status", None)  # status is only written through its subresource

    async def _patch(self, request: kmock.Request, scale: bool = False
                     ) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            current = copy.deepcopy(self.objects[key].raw)
            new = self._scaled(request, current) if scale else self._patched(request, current)
            if new == current:  # a no-op patch neither bumps the version nor notifies anyone
                return aiohttp.web.json_response(_scale_of(new) if scale else current)
            self._admit(request.resource, new)
            self._bump(new, current, subresource=request.subresource)
            meta = new["metadata"]
            self.objects[key].history.append(new)
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self.objects[key].delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": new})
            else:
                await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
        await self._collect_garbage()
        return aiohttp.web.json_response(_scale_of(new) if scale else new)

    async def _scale(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The `scale` subresource of Deployments: GET and PATCH an autoscaling/v1 Scale."""
        if request.method.value == "PATCH":
            return await self._patch(request, scale=True)
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted or request.method.value != "GET":
            raise kmock.KubernetesObjectNotFoundError()
        return aiohttp.web.json_response(_scale_of(self.objects[key].raw))

    def _scaled(self, request: kmock.Request, current: dict[str, Any]) -> dict[str, Any]:
        scale = merge_patch(_scale_of(current), request.data)
        new = copy.deepcopy(current)
        new.setdefault("spec", {})["replicas"] = (scale.get("spec") or {}).get("replicas", 0)
        return new

    def _patched(self, request: kmock.Request, current: dict[str, Any]) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            if content_type == "application/json-patch+json":
                new = jsonpatch.apply_patch(current, request.data, in_place=False)
            elif content_type == "application/strategic-merge-patch+json":
                new = strategic_merge_patch(current, request.data)
            else:
                new = merge_patch(current, request.data)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
        wanted_version = (request.data if isinstance(request.data, dict) else {}).get(
            "metadata", {}).get("resourceVersion")
        if wanted_version and wanted_version != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                "the object has been modified; please apply your changes to the latest version"))
        for field in ("uid", "name", "namespace", "creationTimestamp", "resourceVersion",
                      "generation", "deletionTimestamp"):
            if field in current["metadata"]:
                new["metadata"][field] = current["metadata"][field]
        has_status = "status" in self._resource_info(request.resource).subresources
        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
        elif has_status:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in current:
                new["status"] = current["status"]
        return {k: v for k, v in new.items() if v is not None}

    def _bump(self, new: dict[str, Any], current: dict[str, Any], subresource: str | None) -> None:
        new["metadata"]["resourceVersion"] = self._next_version()
        spec_changed = any(new.get(k) != current.get(k) for k in set(new) | set(current)
                           if k not in ("metadata", "status", "apiVersion", "kind"))
        if subresource != "status" and spec_changed:
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1

    async def _collect_garbage(self) -> None:
        """Delete (or mark for deletion) every object whose owners are all gone."""
        while True:
            async with self._lock:
                alive = {obj.raw["metadata"].get("uid") for obj in self.objects.values()
                         if not obj.deleted}
                orphans = [
                    (key, obj) for key, obj in self.objects.items()
                    if not obj.deleted and (refs := obj.raw["metadata"].get("ownerReferences"))
                    and not any(ref.get("uid") in alive for ref in refs)
                    and not obj.raw["metadata"].get("deletionTimestamp")
                ]
                for (resource, _, _), obj in orphans:
                    if obj.raw["metadata"].get("finalizers"):
                        obj.patch({"metadata": {"deletionTimestamp": _now(),
                                                "resourceVersion": self._next_version()}})
                        await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
                    else:
                        raw = obj.raw
                        obj.delete()
                        await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return

    # -- discovery ---------------------------------------------------------------------------

    def _resource_info(self, resource: kmock.resource | None) -> kmock.ResourceInfo:
        if resource is not None and resource in self.resources:
            return self.resources[resource]
        return kmock.ResourceInfo()

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec.get("versions", []):
            key = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"),
                namespaced=spec.get("scope") == "Namespaced",
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])), verbs=ALL_VERBS,
                subresources=set((version.get("subresources") or {}).keys()))
            self.printer_columns[key] = list(version.get("additionalPrinterColumns") or [])
            self.schemas[key] = (version.get("schema") or {}).get("openAPIV3Schema") or {}

    async def _serve_apis(self, request: kmock.Request) -> Any:
        result = await super()._serve_apis(request)
        for group in result["groups"]:
            _prefer_newest(group)
        return result

    async def _serve_group(self, request: kmock.Request) -> Any:
        return _prefer_newest(await super()._serve_group(request))

    async def _serve_version(self, request: kmock.Request) -> Any:
        result = await super()._serve_version(request)
        result["groupVersion"] = result["groupVersion"].lstrip("/")  # "v1", not "/v1"
        for entry in result["resources"]:
            if "/" in entry["name"]:  # a subresource answers to no short name or category
                entry.update(shortNames=[], categories=[])
        return result

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        assert request.resource is not None
        resource, info = request.resource, self._resource_info(request.resource)
        items = sorted(result["items"], key=lambda obj: (  # etcd's key order, as listed
            obj["metadata"].get("namespace") or "", obj["metadata"]["name"]))
        if self._table_columns(request) is not None:
            return self._table(request, items)
        kind = info.kind or str(resource.plural).capitalize()
        return {"apiVersion": f"{resource.group}/{resource.version}".lstrip("/"),
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": self._latest_version()},
                "items": items}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = await super()._serve_fetch(request)
        return obj if self._table_columns(request) is None else self._table(request, [obj])

    def _table_columns(self, request: kmock.Request) -> list[dict[str, Any]] | None:
        if not kmock_table.wants_table(request.headers.get("Accept", "")):
            return None
        return self.printer_columns.get(request.resource) if request.resource else None

    def _table(self, request: kmock.Request, objects: list[Any], headers: bool = True) -> Any:
        columns = self._table_columns(request) or []
        return kmock_table.table(objects, columns, request.params.get("includeObject", "Metadata"),
                                 self._latest_version(), headers)

    def _latest_version(self) -> str:
        versions = [int(obj.raw["metadata"].get("resourceVersion", 0))
                    for obj in self.objects.values() if not obj.deleted]
        return str(max(versions, default=0))

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """Existing objects newer than ?resourceVersion as ADDED, then every later event.

        The bus is marked under the same lock as the snapshot, so nothing falls between."""
        yield b""
        assert request.resource is not None
        since = request.params.get("resourceVersion", "")
        async with self._lock:
            mark = await self._buses[request.resource].mark()
            objects = [obj.raw for obj in self._KubernetesEmulator__get_objs(request, strict=False)
                       if not obj.deleted]
        for obj in objects:
            version = obj.get("metadata", {}).get("resourceVersion", "0")
            if not (since.isdigit() and int(version) <= int(since)):
                yield self._watch_event(request, {"type": "ADDED", "object": obj})
        async for event in mark:
            meta = event.get("object", {}).get("metadata", {})
            if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                               meta.get("name"), strict=False):
                yield self._watch_event(request, event)

    def _watch_event(self, request: kmock.Request, event: dict[str, Any]) -> dict[str, Any]:
        if self._table_columns(request) is None:
            return event
        return {"type": event["type"], "object": self._table(request, [event["object"]])}


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first."""
    found = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if found is None:
        return (3, 0, 0)
    major, level, minor = found.groups()
    return ({None: 0, "beta": 1, "alpha": 2}[level], -int(major), -int(minor or 0))


def _prefer_newest(group: dict[str, Any]) -> dict[str, Any]:
    """kmock lists a group's versions in set order (random per process), so kubectl would pick
    autoscaling/v1 or v2 by chance; the API server prefers the most stable, newest version."""
    group["versions"].sort(key=lambda v: _version_priority(v["version"]))
    group["preferredVersion"] = group["versions"][0]
    return group


def _scale_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                              "creationTimestamp") if k in meta},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                       "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}
