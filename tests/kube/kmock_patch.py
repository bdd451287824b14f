"""PATCH bodies as the API server applies them, for the emulated API (kmock_compat).

- JSON merge patch (RFC 7386): mappings merge, `null` deletes, lists are replaced.
- Strategic merge patch (what `kubectl patch`, `kubectl set image` and `kubectl apply` send for
  built-in kinds): like a merge patch, except that lists of objects with a patch merge key
  (containers by name, volumeMounts by mountPath, ...) merge item by item, and the directives
  `$patch: delete|replace`, `$setElementOrder/<list>`, `$retainKeys` and
  `$deleteFromPrimitiveList/<list>` are honoured. The merge keys come from the Kubernetes
  types' `patchMergeKey` tags for the fields kubectl touches on the kinds the operator writes;
  a list not in the table is replaced, as the API server does for lists without a merge key.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# field name -> patchMergeKey (ports: containerPort in a container, port in a Service)
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "imagePullSecrets": "name", "volumeMounts": "mountPath",
    "conditions": "type", "ownerReferences": "uid", "hostAliases": "ip",
}
PRIMITIVE_MERGE = {"finalizers"}  # lists of strings with patchStrategy=merge
_ORDER, _DELETE_FROM = "$setElementOrder/", "$deleteFromPrimitiveList/"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, Mapping) else {}
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _patch_list(key, result.get(key), value)
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    for key, value in patch.items():
        if key.startswith(_ORDER) and isinstance(result.get(key[len(_ORDER):]), list):
            field = key[len(_ORDER):]
            result[field] = _ordered(field, result[field], value)
        elif key.startswith(_DELETE_FROM):
            field = key[len(_DELETE_FROM):]
            result[field] = [v for v in result.get(field) or [] if v not in value]
    return result


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        if all(isinstance(i, Mapping) and "containerPort" in i for i in items):
            return "containerPort"
        return "port" if all(isinstance(i, Mapping) and "port" in i for i in items) else None
    return MERGE_KEYS.get(field)


def _patch_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current = list(current) if isinstance(current, list) else []
    if field in PRIMITIVE_MERGE:
        return current + [v for v in patch if v not in current]
    key = _merge_key(field, patch)
    if key is None or not all(isinstance(i, Mapping) and key in i for i in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, Mapping) and "$patch" in v)]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        index = next((i for i, old in enumerate(result)
                      if isinstance(old, Mapping) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(strategic_merge_patch({}, item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def _ordered(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    """Items in the order `$setElementOrder` gives; unlisted ones keep their place after."""
    key = _merge_key(field, [o for o in order if isinstance(o, Mapping)])
    if key is None:
        return items
    rank = {o.get(key): i for i, o in enumerate(order) if isinstance(o, Mapping)}
    return sorted(items, key=lambda item: rank.get(
        item.get(key) if isinstance(item, Mapping) else None, len(rank)))
