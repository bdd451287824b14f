"""Reading from the emulated API as kube-apiserver serves it (kmock_compat builds on this):
discovery with a stable preferred version per group and CRDs registered when created, lists
in name order with kind and resourceVersion, server-side Tables of a CRD's printer columns
(kmock_table) for lists, single objects and watches, and watches that resume after a
resourceVersion without losing an event (the bus is marked under the snapshot's lock), sent
as application/json, and client-go's watch-list (`sendInitialEvents`, ended by a bookmark).
Lists and watches honour `?labelSelector=` (equality, inequality and existence:
`a=b,c!=d,e,!f`; set-based `in`/`notin` are refused with a 400) and `?fieldSelector=` on
metadata.name and metadata.namespace. Subresources answer
to no short name (kubectl warned of ambiguity)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import kmock
from kmock._internal import enums

from tests.kube import kmock_table

ALL_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}


class ReadingEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.printer_columns: dict[kmock.resource, list[dict[str, Any]]] = {}
        self.schemas: dict[kmock.resource, dict[str, Any]] = {}  # of custom resources
        # client-go (kubectl -w, --wait) rejects kmock's application/octet-stream watches.
        (self.fallback ** 1)[enums.action.WATCH] << kmock.headers(
            {"Content-Type": "application/json"}) << self._serve_watch

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
        selected = selector(request)
        items = sorted((obj for obj in result["items"] if selected(obj)), key=lambda obj: (
            obj["metadata"].get("namespace") or "", obj["metadata"]["name"]))  # etcd's order
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
        With ?sendInitialEvents=true (client-go's watch-list: `kubectl delete` waits this way)
        every existing object, then a BOOKMARK marking the end of the initial events.

        The bus is marked under the same lock as the snapshot, so nothing falls between."""
        yield b""
        assert request.resource is not None
        initial = request.params.get("sendInitialEvents") == "true"
        since = "" if initial else request.params.get("resourceVersion", "")
        selected = selector(request)
        async with self._lock:
            mark = await self._buses[request.resource].mark()
            objects = [obj.raw for obj in self._KubernetesEmulator__get_objs(request, strict=False)
                       if not obj.deleted]
            version = self._latest_version()
        for obj in objects:
            changed = obj.get("metadata", {}).get("resourceVersion", "0")
            if selected(obj) and not (since.isdigit() and int(changed) <= int(since)):
                yield self._watch_event(request, {"type": "ADDED", "object": obj})
        if initial:
            yield {"type": "BOOKMARK", "object": self._bookmark(request.resource, version)}
        async for event in mark:
            meta = event.get("object", {}).get("metadata", {})
            if selected(event.get("object") or {}) and self._KubernetesEmulator__check(
                    request, request.resource, meta.get("namespace"), meta.get("name"),
                    strict=False):
                yield self._watch_event(request, event)

    def _bookmark(self, resource: kmock.resource, version: str) -> dict[str, Any]:
        kind = self._resource_info(resource).kind or str(resource.plural).capitalize()
        return {"apiVersion": f"{resource.group}/{resource.version}".lstrip("/"), "kind": kind,
                "metadata": {"resourceVersion": version,
                             "annotations": {"k8s.io/initial-events-end": "true"}}}

    def _watch_event(self, request: kmock.Request, event: dict[str, Any]) -> dict[str, Any]:
        if self._table_columns(request) is None:
            return event
        return {"type": event["type"], "object": self._table(request, [event["object"]])}


def selector(request: kmock.Request) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an object matches both the request's label and field selectors."""
    labels, fields = label_filter(request), field_filter(request)
    return lambda obj: labels(obj) and fields(obj)


def field_filter(request: kmock.Request) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an object matches the request's `?fieldSelector=` on metadata.name or
    metadata.namespace (`=`, `==`, `!=`); other fields are refused with a 400."""
    terms = []
    for term in [t.strip() for t in request.params.get("fieldSelector", "").split(",")]:
        found = re.fullmatch(r"metadata\.(name|namespace)\s*(!=|==|=)\s*(.*)", term)
        if term and found is None:
            raise kmock.KubernetesError(status=400, reason="BadRequest", details={},
                                        message=f"field selector {term!r} is not emulated")
        if found is not None:
            terms.append(found.groups())

    def matches(obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return all((meta.get(key) == value) == (op != "!=") for key, op, value in terms)

    return matches


def label_filter(request: kmock.Request) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an object matches the request's `?labelSelector=` (everything without one)."""
    terms = [t.strip() for t in request.params.get("labelSelector", "").split(",") if t.strip()]
    for term in terms:
        if re.search(r"\s(not)?in\s", f" {term} ") or "(" in term:
            raise kmock.KubernetesError(status=400, reason="BadRequest", details={},
                                        message=f"set-based selector {term!r} is not emulated")

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for term in terms:
            key, op, value = re.fullmatch(r"(!?[^!=]+)(?:(!=|==|=)(.*))?", term).groups()  # type: ignore[union-attr]
            if op is None:
                present = key.lstrip("!") in labels
                if present == key.startswith("!"):
                    return False
            elif (labels.get(key) == value) != (op in ("=", "==")):
                return False
        return True

    return matches


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
