"""Small validators for spec fields: each returns the value or raises `InvalidSpec` naming
the field (`where`) and the reason."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")
PERCENT = re.compile(r"^[0-9]+%$")
INT32_MAX = 2**31 - 1  # replica counts are int32 in every Kubernetes API


class InvalidSpec(ValueError):
    """A spec that can never work as written; the message names the field and the reason."""


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpec(f"{where}: expected an object, got {type(value).__name__}")
    return value


def string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSpec(f"{where}: expected a non-empty string, got {value!r}")
    return value


def matching(value: Any, where: str, pattern: re.Pattern[str]) -> str:
    text = string(value, where)
    if not pattern.match(text):
        raise InvalidSpec(f"{where} {text!r}: must match {pattern.pattern}")
    return text


def choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidSpec(f"{where} {value!r}: must be one of {', '.join(choices)}")
    return str(value)


def integer(value: Any, where: str, *, minimum: int, maximum: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidSpec(f"{where} {value!r}: expected an integer from {minimum} to {maximum}")
    return value


def int_or_percent(value: Any, where: str) -> int | str:
    if isinstance(value, str) and PERCENT.match(value):
        return value
    return integer(value, where, minimum=0)


def strings(value: Any, where: str) -> tuple[str, ...]:
    items = as_list(value, where)
    if not all(isinstance(item, str) for item in items):
        raise InvalidSpec(f"{where}: expected a list of strings")
    return tuple(items)


def objects(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    items = as_list(value, where)
    if not all(isinstance(item, Mapping) for item in items):
        raise InvalidSpec(f"{where}: expected a list of objects")
    return tuple(items)


def env_vars(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    items = objects(value, where)
    for i, item in enumerate(items):
        string(item.get("name"), f"{where}[{i}].name")
    return items


def string_map(value: Any, where: str) -> Mapping[str, str]:
    result = mapping(value, where)
    if not all(isinstance(v, str) for v in result.values()):
        raise InvalidSpec(f"{where}: expected string values")
    return result


def as_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidSpec(f"{where}: expected a list, got {type(value).__name__}")
    return value


PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def peers(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    """NetworkPolicyPeer list: each names pods (podSelector and/or namespaceSelector) or
    addresses (ipBlock), never both."""
    items = objects(value, where)
    for i, peer in enumerate(items):
        at = f"{where}[{i}]"
        unknown = set(peer) - set(PEER_KEYS)
        if unknown or not peer:
            raise InvalidSpec(f"{at}: expected podSelector, namespaceSelector or ipBlock, "
                              f"got {sorted(unknown) or 'nothing'}")
        if "ipBlock" in peer and len(peer) > 1:
            raise InvalidSpec(f"{at}: ipBlock cannot be combined with a selector")
        if "ipBlock" in peer:
            block = mapping(peer["ipBlock"], f"{at}.ipBlock")
            string(block.get("cidr"), f"{at}.ipBlock.cidr")
            strings(block.get("except"), f"{at}.ipBlock.except")
        for key in ("podSelector", "namespaceSelector"):
            if key in peer:
                label_selector(peer[key], f"{at}.{key}")
    return items


def label_selector(value: Any, where: str) -> Mapping[str, Any]:
    selector = mapping(value, where)
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise InvalidSpec(f"{where}: unknown fields {sorted(unknown)}")
    string_map(selector.get("matchLabels"), f"{where}.matchLabels")
    for i, term in enumerate(objects(selector.get("matchExpressions"), f"{where}.matchExpressions")):
        at = f"{where}.matchExpressions[{i}]"
        string(term.get("key"), f"{at}.key")
        operator = choice(term.get("operator"), f"{at}.operator", SELECTOR_OPERATORS)
        values = strings(term.get("values"), f"{at}.values")
        if (operator in ("In", "NotIn")) != bool(values):
            raise InvalidSpec(f"{at}: {operator} {'needs' if not values else 'takes no'} values")
    return selector
