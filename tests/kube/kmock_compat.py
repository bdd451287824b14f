"""An emulated Kubernetes API for the operator tests: kmock 0.8 plus what `kopf run` and
`kubectl` need from a real API server (the gaps are listed below).

On top of `kmock.KubernetesEmulator` and the reading side in kmock_reads this adds:
- object bookkeeping: uid, resourceVersion, generation (bumped on spec changes),
  creationTimestamp, generateName, apiVersion and kind;
- PATCH as the API server does it: JSON patch (a failed `test` is 422), merge patch, strategic
  merge patch (kmock_patch), the `status` subresource (status-only) vs. the main resource
  (status ignored), the `scale` subresource of Deployments (an autoscaling/v1 Scale, as
  `kubectl scale` uses it), optimistic concurrency on metadata.resourceVersion, and no-op
  patches that change nothing at all;
- what the API server does to a write (kmock_admission): a custom resource's schema
  defaults; int32 overflows (400), invalid Ingress hosts and names (422), admission
  policies installed by a test (422);
- authentication by bearer token and RBAC from the stored Roles and bindings (kmock_rbac);
- CRDs created through the API registered for discovery, Tables, lists and watches as the
  API server serves them (kmock_reads, kmock_table);
- owner-reference garbage collection (immediate) like kube-controller-manager;
- injected faults (503 for the next N requests of a method on a resource);
- /api/v1/namespaces parsed as the cluster-scoped resource it is (kopf's namespace scanning).
Still absent: field selectors other than metadata.name/namespace (selectors: kmock_reads),
PUT, server-side apply, OpenAPI schema validation, CEL validation rules, defaulting of
built-in kinds, protobuf.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import enums, parsing

from tests.kube import kmock_admission as admission
from tests.kube import kmock_rbac as rbac
from tests.kube.kmock_patch import merge_patch, strategic_merge_patch
from tests.kube.kmock_reads import ReadingEmulator

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
RBAC_PLURALS = ("roles", "clusterroles", "rolebindings", "clusterrolebindings")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Seen:
    """A request as the tests look back on it."""

    method: str
    path: str
    plural: str | None


class Emulator(ReadingEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.seen: list[Seen] = []  # every request, in order of arrival
        self._versions = itertools.count(1)
        self.faults: dict[tuple[str, str], int] = {}  # (method, plural) -> failures left
        self.policies: list[admission.Policy] = []
        self.audit: list[tuple[str, rbac.Attributes, bool]] = []  # RBAC-checked requests

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self.seen.append(Seen(request.method.value, request.url.path,
                              str(request.resource.plural) if request.resource else None))
        try:
            return await self._serve(request)
        finally:
            self._forget(request)

    def _forget(self, request: kmock.Request) -> None:
        """Drop a served request from kmock's own logs. kmock keeps every request and, to route
        the next one, scans that log once per reaction (`request in reaction's view`): each
        request cost more than the one before, and after a few thousand an API call took
        seconds. Only requests still being served need to be there; `seen` keeps the history."""
        self._requests[:] = [r for r in self._requests if r is not request]
        for reaction in self._payloads:
            if len(reaction._requests) > 64:  # what each reaction served: nobody reads it here
                del reaction._requests[:-16]

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
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
        # kube-controller-manager's garbage collector also deletes an object created with an
        # owner already gone: a reconcile pass that read its owner before the deletion does that.
        if response.status < 300 and request.action in (enums.action.CREATE,
                                                        enums.action.DELETE):
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


def _scale_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                              "creationTimestamp") if k in meta},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                       "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}
