"""Server-side printing for the emulated API: `kubectl get` asks for a `meta.k8s.io/v1` Table
(`Accept: application/json;as=Table;...`) and prints the columns the server chose. For a
custom resource those are `Name` plus the CRD's `additionalPrinterColumns`, each cell found
with the column's JSONPath, as kube-apiserver's CRD table convertor does:
- no match -> null (kubectl prints `<none>`); only the first match counts;
- `string` cells are the value printed as text, `integer` cells numbers, `date` cells the
  age since the timestamp ("45s", "3m12s", ...);
- priority > 0 columns are sent too; kubectl shows them with `-o wide`.
The JSONPath subset is what printer columns use: `.a.b`, `.a[0]`, `.a[*]` and
`.a[?(@.key=="value")]` (tests/operator/test_operator_emulator.py checks it against kubectl's
own JSONPath engine).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from typing import Any

_STEP = re.compile(r"""\.([A-Za-z0-9_-]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_-]+)\s*==\s*["']([^"']*)["']\)\]""")
NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
               "description": "Name must be unique within a namespace."}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value `path` selects in `obj`, in order."""
    path = path.strip().removeprefix("{").removesuffix("}")
    values, pos = [obj], 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        field, index, key, wanted = step.groups()
        values = [picked for value in values for picked in _step(value, field, index, key, wanted)]
        pos = step.end()
    return values


def _step(value: Any, field: str | None, index: str | None, key: str | None,
          wanted: str | None) -> list[Any]:
    if field is not None:
        return [value[field]] if isinstance(value, Mapping) and field in value else []
    if not isinstance(value, list):
        return []
    if index == "*":
        return list(value)
    if index is not None:
        return [value[int(index)]] if int(index) < len(value) else []
    return [item for item in value if isinstance(item, Mapping) and str(item.get(key)) == wanted]


def age(timestamp: str, now: datetime.datetime | None = None) -> str:
    """Kubernetes' HumanDuration of the time since `timestamp`."""
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc)
    seconds = int(((now or datetime.datetime.now(datetime.timezone.utc)) - then).total_seconds())
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    return f"{hours}h" if hours < 48 else f"{hours // 24}d"


def cell(column: Mapping[str, Any], obj: Mapping[str, Any]) -> Any:
    found = jsonpath(obj, column["jsonPath"])
    if not found or found[0] is None:
        return None
    value, kind = found[0], column.get("type", "string")
    if kind == "integer":
        return int(value) if isinstance(value, (int, float)) and float(value).is_integer() else None
    if kind == "date":
        return age(value) if isinstance(value, str) else None
    if kind in ("number", "boolean"):
        return value
    return value if isinstance(value, str) else json.dumps(value)


def table(objects: list[Mapping[str, Any]], columns: list[Mapping[str, Any]],
          include_object: str, resource_version: str, headers: bool = True) -> dict[str, Any]:
    definitions = [NAME_COLUMN] + [
        {"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
         "description": c.get("description", ""), "priority": c.get("priority", 0)}
        for c in columns]
    return {
        "kind": "Table", "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions if headers else [],
        "rows": [{"cells": [obj["metadata"]["name"], *(cell(c, obj) for c in columns)],
                  "object": _row_object(obj, include_object)} for obj in objects],
    }


def _row_object(obj: Mapping[str, Any], include: str) -> Any:
    if include == "Object":
        return obj
    if include == "None":
        return None
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"]}
