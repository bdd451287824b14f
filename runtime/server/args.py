"""`baton serve` argument parsing: one flag per ServerArgs field, defaults from the dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from runtime.config import ServerArgs


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field[Any], tp: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    if f.default is not dataclasses.MISSING:
        default = f.default
    else:
        default = f.default_factory()  # type: ignore[misc,operator]
    help_text = f.metadata.get("help", "")
    help_text = f"{help_text} (default: {default})".strip()
    tp, _ = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if tp is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    elif origin is typing.Literal:
        parser.add_argument(flag, choices=list(typing.get_args(tp)), default=default, help=help_text)
    elif origin is tuple:
        parser.add_argument(flag, action="append", default=None, help=help_text)
    else:
        parser.add_argument(flag, type=tp, default=default, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton serve", description="OpenAI-compatible server for one model"
    )
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        _add_flag(parser, f, hints[f.name])
    return parser


def parse_server_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    ns["plugin"] = tuple(ns["plugin"] or ())
    args = ServerArgs(**ns)
    problems = _check(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def _check(args: ServerArgs) -> list[str]:
    problems = []
    for name in ("port", "max_running_requests", "max_total_tokens", "chunked_prefill_size",
                 "stream_interval", "forced_stream_interval", "page_size", "max_body_bytes"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_timeout_s <= 0 or args.shutdown_grace_s < 0:
        problems.append("--request-timeout-s must be > 0 and --shutdown-grace-s >= 0")
    return problems
