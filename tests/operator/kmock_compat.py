"""An emulated Kubernetes API for the operator tests: kmock 0.8 plus what `kopf run` and
`kubectl` need from a real API server (../shared/ENVIRONMENT.md lists the gaps).

On top of `kmock.KubernetesEmulator` this adds:
- object bookkeeping: uid, resourceVersion, generation (bumped on spec changes),
  creationTimestamp, generateName;
- PATCH as the API server does it: JSON patch (a failed `test` is 422), merge patch,
  the `status` subresource (status-only) vs. the main resource (status ignored), optimistic
  concurrency on metadata.resourceVersion, and no-op patches that change nothing at all;
- CRDs created through the API register their resource for discovery;
- watches that honour ?resourceVersion and lose no event between snapshot and stream, sent
  as application/json; lists with kind, apiVersion and a resourceVersion; core discovery
  with groupVersion "v1";
- owner-reference garbage collection (immediate) like kube-controller-manager;
- injected faults (503 for the next N requests of a method on a resource).
- /api/v1/namespaces parsed as the cluster-scoped resource it is (kopf's namespace scanning).
Still absent: label/field selectors, PUT, schema validation and defaulting, protobuf.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import enums, parsing

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


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Emulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self.faults: dict[tuple[str, str], int] = {}  # (method, plural) -> failures left
        # client-go (kubectl -w, --wait) rejects kmock's application/octet-stream watches.
        (self.fallback ** 1)[enums.action.WATCH] << kmock.headers(
            {"Content-Type": "application/json"}) << self._serve_watch

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        fault = (request.method.value, str(request.resource.plural))
        if self.faults.get(fault, 0) > 0:
            self.faults[fault] -= 1
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                        message="injected fault", details={})
        if request.action == enums.action.UPDATE and request.name is not None:
            return await self._patch(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            self._stamp_new(request)
        response = await super()._handle(request)
        if response.status < 300 and request.action == enums.action.CREATE:
            if not response.prepared:
                response.set_status(201)  # Created, as clients generated from the OpenAPI expect
            if request.resource == CRD:
                self._register_crd(request.data)
        if response.status < 300 and request.action == enums.action.DELETE:
            await self._collect_garbage()
        return response

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
        if "status" in self._resource_info(request.resource).subresources:
            body.pop("status", None)  # status is only written through its subresource

    async def _patch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            current = copy.deepcopy(self.objects[key].raw)
            new = self._patched(request, current)
            if new == current:  # a no-op patch neither bumps the version nor notifies anyone
                return aiohttp.web.json_response(current)
            self._bump(new, current, subresource=request.subresource)
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self.objects[key].history.append(new)
                self.objects[key].delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": new})
            else:
                self.objects[key].history.append(new)
                await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
        await self._collect_garbage()
        return aiohttp.web.json_response(new)

    def _patched(self, request: kmock.Request, current: dict[str, Any]) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            if content_type == "application/json-patch+json":
                new = jsonpatch.apply_patch(current, request.data, in_place=False)
            else:  # merge-patch; strategic merge approximated by it (lists are replaced)
                new = _merge_patch(current, request.data)
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
            self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular"),
                namespaced=spec.get("scope") == "Namespaced",
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])), verbs=ALL_VERBS,
                subresources=set((version.get("subresources") or {}).keys()))

    async def _serve_version(self, request: kmock.Request) -> Any:
        result = await super()._serve_version(request)
        result["groupVersion"] = result["groupVersion"].lstrip("/")  # "v1", not "/v1"
        return result

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        assert request.resource is not None
        resource, info = request.resource, self._resource_info(request.resource)
        kind = info.kind or str(resource.plural).capitalize()
        return {"apiVersion": f"{resource.group}/{resource.version}".lstrip("/"),
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": self._latest_version()},
                "items": result["items"]}

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
                yield {"type": "ADDED", "object": obj}
        async for event in mark:
            meta = event.get("object", {}).get("metadata", {})
            if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                               meta.get("name"), strict=False):
                yield event


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


class EmulatedCluster:
    """The emulator served on 127.0.0.1:<random port> from its own thread and event loop."""

    def __init__(self) -> None:
        self.emulator: Emulator | None = None
        self.url = ""
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True,
                                        name="kmock")

    async def _serve(self) -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._started.set()
            await self._stop.wait()

    @contextmanager
    def running(self, timeout: float = 15) -> Iterator[EmulatedCluster]:
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("the emulated API server did not start")
        try:
            yield self
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    def fail(self, method: str, plural: str, times: int) -> None:
        """Answer the next `times` `method` requests on `plural` with 503."""
        assert self.emulator is not None
        self.emulator.faults[method, plural] = times

    def request_count(self) -> int:
        return len(self._requests())

    def writes(self, after: int = 0, kinds: tuple[str, ...] = ()) -> list[str]:
        """`METHOD /path` of the mutating requests since the `after`-th request, optionally
        only those on resources whose plural is in `kinds`."""
        return [f"{r.method.value} {r.url.path}" for r in self._requests()[after:]
                if r.method.value in ("POST", "PUT", "PATCH", "DELETE")
                and (not kinds or (r.resource is not None and r.resource.plural in kinds))]

    def _requests(self) -> list[kmock.Request]:
        assert self.emulator is not None
        return [r for r in list(self.emulator) if isinstance(r, kmock.Request)]

    def kubeconfig(self) -> str:
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: kmock, cluster: {{server: \"{self.url}\"}}}}]\n"
            "users: [{name: tester, user: {token: test-token}}]\n"
            "contexts: [{name: kmock, context: {cluster: kmock, user: tester, namespace: default}}]\n"
            "current-context: kmock\n"
        )
