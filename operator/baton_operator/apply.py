"""Create-or-restore of one child: the fields we manage are compared with the LIVE object.

What we manage is what the builders render. For each of those fields the live value must
contain ours: mappings may carry extra keys (server defaults, another controller's
annotation), lists must match item for item (an item may carry extra defaulted keys), the
atomic maps listed in `ATOMIC` must be equal. Anything else is restored with one JSON merge
patch, so `kubectl scale`, a patched image or a hijacked Service selector are undone on the
next pass. Fields nobody renders (an HPA's `spec.replicas` once autoscaling is on, labels
added by others) are left alone. Fields we rendered before but no longer do are removed: the
manifest of the last pass is kept in an annotation, as `kubectl apply` does.

Real Kubernetes offers the same through server-side apply with a field manager (the emulated
API of the tests cannot do it); the difference: server-side apply merges lists keyed by name
(another manager's extra container survives), while this restores our lists whole.

We only ever write to objects we control (a controller owner reference with our uid). A child
name taken by anything else is a `NameConflict`: reported, never patched or adopted.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from baton_operator.kube import ApiError, Kube

LAST_APPLIED = "baton.dev/last-applied"
# Fields another controller takes over when we stop rendering them (the HPA owns replicas).
HANDED_OVER = (("spec", "replicas"),)
# Maps that are one value, not a set of keys (`+mapType=atomic` / `+structType=atomic` in the
# Kubernetes types): an added key changes what they select.
ATOMIC = (("spec", "selector"), ("spec", "template", "spec", "nodeSelector"))
TEMPLATE = ("spec", "template")
Outcome = Literal["created", "patched", "unchanged"]


class NameConflict(Exception):
    """A child's name is taken by an object this service does not control."""


@dataclass(frozen=True)
class Applied:
    outcome: Outcome
    live: Mapping[str, Any]  # the object as the API server returned it after this
    fields: tuple[str, ...] = ()  # the fields a patch restored or removed

    def describe(self) -> str:
        shown = ", ".join(self.fields[:4]) + (", ..." if len(self.fields) > 4 else "")
        return f" ({shown})" if shown else ""


def apply(kube: Kube, desired: Mapping[str, Any], owner_uid: str,
          untrusted: Callable[[Mapping[str, Any]], bool] = lambda live: False) -> Applied:
    """Create the child, or restore the fields we manage; never touch what is not ours.

    When `untrusted(live)` (a pod template someone made privileged, say), the whole
    `spec.template` is put back exactly as rendered, extra fields removed."""
    api_version, kind = desired["apiVersion"], desired["kind"]
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    body = _with_last_applied(desired)
    live = kube.get(api_version, kind, namespace, name)
    if live is None:
        try:
            return Applied("created", kube.create(body))
        except ApiError as e:
            live = kube.get(api_version, kind, namespace, name) if e.status == 409 else None
            if live is None:
                raise
    check_controller(live, desired, owner_uid)
    patch = restore_patch(live, body, ATOMIC + ((TEMPLATE,) if untrusted(live) else ()))
    patch = merge_patches(removal_patch(_last_applied(live), desired, live), patch)
    if not patch:
        return Applied("unchanged", live)
    live = kube.patch(api_version, kind, namespace, name, patch)
    return Applied("patched", live, tuple(p for p in leaf_paths(patch) if LAST_APPLIED not in p))


def delete_owned(kube: Kube, api_version: str, kind: str, namespace: str, name: str,
                 owner_uid: str) -> bool:
    """Delete a child we no longer want, only if we are its controller."""
    live = kube.get(api_version, kind, namespace, name)
    if live is None or controller_uid(live) != owner_uid:
        return False
    return kube.delete(api_version, kind, namespace, name)


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def check_controller(live: Mapping[str, Any], desired: Mapping[str, Any], uid: str) -> None:
    """Raise `NameConflict` unless `live` is controlled by the owner with `uid`."""
    if controller_uid(live) == uid:
        return
    what = f"{live.get('kind', desired['kind'])} {desired['metadata']['name']}"
    ours = desired["metadata"]["ownerReferences"][0]
    ref = next((r for r in (live.get("metadata") or {}).get("ownerReferences") or []
                if r.get("controller")), None)
    if ref is None:
        owner = "has no controller (made by hand or by another tool)"
    elif (ref.get("kind"), ref.get("name")) == (ours["kind"], ours["name"]):
        owner = (f"belongs to a deleted {ref.get('kind')} {ref.get('name')} (uid "
                 f"{ref.get('uid')}) and waits for garbage collection")
    else:
        owner = f"is controlled by {ref.get('kind')} {ref.get('name')}"
    raise NameConflict(f"{what} already exists and {owner}; this service does not take it "
                       "over: delete it or rename the service")


def restore_patch(live: Mapping[str, Any], desired: Mapping[str, Any],
                  atomic: tuple[tuple[str, ...], ...] = ATOMIC,
                  path: tuple[str, ...] = ()) -> dict[str, Any]:
    """The merge patch that puts every field of `desired` back into `live`; the maps at the
    `atomic` paths must be equal, not merely contain ours."""
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        here = (*path, key)
        if here == ("metadata", "ownerReferences"):
            continue  # checked by check_controller; other owners' references are theirs
        have = live.get(key)
        if here in atomic:
            if have != want:
                patch[key] = replacement(have, want)
        elif isinstance(want, Mapping) and isinstance(have, Mapping):
            sub = restore_patch(have, want, atomic, here)
            if sub:
                patch[key] = sub
        elif key not in live or not covers(have, want):
            patch[key] = copy.deepcopy(want)
    return patch


def covers(have: Any, want: Any) -> bool:
    """Whether the live value `have` holds everything of `want` (extra defaulted keys ok)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            key in have and covers(have[key], value) for key, value in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(have) == len(want)
                and all(covers(h, w) for h, w in zip(have, want, strict=True)))
    if isinstance(want, bool) or isinstance(have, bool):
        return have is want
    return bool(have == want)


def replacement(have: Any, want: Any) -> Any:
    """A merge patch value that makes `have` exactly `want` (nulls for keys it must lose)."""
    if not (isinstance(have, Mapping) and isinstance(want, Mapping)):
        return copy.deepcopy(want)
    patch: dict[str, Any] = {key: None for key in have if key not in want}
    for key, value in want.items():
        if have.get(key) != value:
            patch[key] = replacement(have.get(key), value)
    return patch


def removal_patch(last: Mapping[str, Any], desired: Mapping[str, Any],
                  live: Mapping[str, Any]) -> dict[str, Any]:
    """Nulls for the fields we rendered last time and no longer do (when still live)."""
    last = copy.deepcopy(dict(last))
    for path in HANDED_OVER:
        if _lookup(desired, path) is None:
            _forget(last, path)
    return _removals(last, desired, live)


def _removals(last: Mapping[str, Any], desired: Mapping[str, Any],
              live: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, before in last.items():
        if key not in live:
            continue
        if key not in desired:  # a map others write into too loses only our keys
            theirs = isinstance(before, Mapping) and isinstance(live[key], Mapping) and (
                live[key].keys() - before.keys())
            patch[key] = _removals(before, {}, live[key]) if theirs else None
        elif isinstance(before, Mapping) and isinstance(desired[key], Mapping) and isinstance(
                live[key], Mapping):
            sub = _removals(before, desired[key], live[key])
            if sub:
                patch[key] = sub
    return patch


def merge_patches(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """Both merge patches in one (`second` wins where both set a value)."""
    out = copy.deepcopy(dict(first))
    for key, value in second.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_patches(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def leaf_paths(patch: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            yield from leaf_paths(value, path)
        else:
            yield path


def _with_last_applied(desired: Mapping[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(dict(desired))
    applied = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied
    return body


def _last_applied(live: Mapping[str, Any]) -> dict[str, Any]:
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json.loads(text) if text else {}
    except ValueError:
        return {}  # a mangled annotation: nothing to remove, the restore still runs
    return last if isinstance(last, dict) else {}


def _lookup(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _forget(obj: Mapping[str, Any], path: tuple[str, ...]) -> None:
    parent = _lookup(obj, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)
