"""`baton serve` argument parsing: one flag per ServerArgs field, defaults from the dataclasses.

ServerArgs composes EngineConfig, SchedulerConfig and DisaggConfig; their fields are flags too
(`--max-total-tokens`), parsed flat and put back together. The disagg timeouts may also come
from the environment (BATON_<FIELD>, e.g. BATON_BOOTSTRAP_TIMEOUT_S), read here once; a flag
wins over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

from runtime.auth.api_keys import ApiKeys
from runtime.auth.key import load_cluster_key
from runtime.canary.perturb_kinds import parse_perturb, uncatchable
from runtime.config import CanaryConfig, DisaggConfig, ServerArgs
from runtime.revision import ENV as revision_env
from runtime.revision import check as check_revision
from runtime.revision import derive as derive_revision

ENV_FIELDS = ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s", "heartbeat_misses")


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return tp


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc,operator]


def _env_default(name: str, default: Any, tp: Any) -> Any:
    raw = os.environ.get(f"BATON_{name.upper()}") if name in ENV_FIELDS else None
    if raw is None:
        return default
    try:
        return tp(raw)
    except ValueError:
        raise SystemExit(f"baton serve: BATON_{name.upper()}={raw!r} is not a {tp.__name__}") from None


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field[Any], tp: Any) -> None:
    flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
    tp = _unwrap_optional(tp)
    default = _env_default(f.name, _default(f), tp)
    help_text = f"{f.metadata.get('help', '')} (default: {default})".strip()
    origin = typing.get_origin(tp)
    if tp is bool:
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)
    elif origin is typing.Literal:
        parser.add_argument(*flags, choices=list(typing.get_args(tp)), default=default, help=help_text)
    elif origin is tuple:
        parser.add_argument(*flags, action="append", default=None, help=help_text)
    else:
        parser.add_argument(*flags, type=tp, default=default, help=help_text)


def _sections() -> dict[str, type]:
    """ServerArgs' nested configs: field name -> dataclass."""
    hints = typing.get_type_hints(ServerArgs)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServerArgs)
            if dataclasses.is_dataclass(hints[f.name])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton serve", description="OpenAI-compatible server for one model"
    )
    sections = _sections()
    for cls in [ServerArgs, *sections.values()]:
        hints = typing.get_type_hints(cls)
        group = parser if cls is ServerArgs else parser.add_argument_group(cls.__name__)
        for f in dataclasses.fields(cls):
            if f.name not in sections:
                _add_flag(group, f, hints[f.name])  # type: ignore[arg-type]
    return parser


def parse_server_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    ns["plugin"] = tuple(ns["plugin"] or ())
    ns["api_key"] = tuple(ns["api_key"] or ())
    nested = {
        name: cls(**{f.name: ns.pop(f.name) for f in dataclasses.fields(cls)})
        for name, cls in _sections().items()
    }
    args = ServerArgs(**nested, **ns)
    revision = args.revision or os.environ.get(revision_env) or derive_revision(args.engine)
    args = dataclasses.replace(args, revision=revision)
    problems = _check(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def _check_quantization(kind: str, device: str) -> list[str]:
    if kind in ("int8", "int4") and not device.startswith("cpu"):
        return [f"--quantization {kind} is a CPU mode (on CUDA: --quantization fp8, or an fp8 "
                "checkpoint)"]
    if kind == "fp8" and not device.startswith("cuda"):
        return ["--quantization fp8 needs --device cuda (fp8 GEMMs, sm_89 or later); on the CPU "
                "use --quantization int8 or int4"]
    return []


def _check(args: ServerArgs) -> list[str]:
    problems = []
    for obj, names in (
        (args, ("port", "max_body_bytes")),
        (args.engine, ("max_total_tokens", "page_size", "tp", "quant_max_rows")),
        (args.scheduler, ("max_running_requests", "chunked_prefill_size", "stream_interval",
                          "forced_stream_interval")),
        (args.disagg, ("heartbeat_misses",)),
    ):
        problems += [f"--{n.replace('_', '-')} must be >= 1" for n in names if getattr(obj, n) < 1]
    problems += _check_canary(args.canary, args.engine.sampler_backend)
    problems += [p for p in [check_revision(args.revision or "")] if p]
    fraction = args.engine.mem_fraction_static
    if fraction is not None and not 0.0 < fraction < 1.0:
        problems.append(f"--mem-fraction-static must be in (0, 1), got {fraction}")
    if fraction is not None and not args.engine.device.startswith("cuda"):
        problems.append("--mem-fraction-static sizes the KV pool from GPU memory: it needs --device cuda "
                        "(on the CPU, --max-total-tokens sets the pool)")
    problems += _check_quantization(args.engine.quantization, args.engine.device)
    if args.engine.tp_timeout_s <= 0:
        problems.append("--tp-timeout-s must be > 0")
    if args.request_timeout_s <= 0 or args.shutdown_grace_s < 0 or args.stall_timeout_s <= 0:
        problems.append("--request-timeout-s and --stall-timeout-s must be > 0 and "
                        "--shutdown-grace-s >= 0")
    d: DisaggConfig = args.disagg
    if min(d.bootstrap_timeout_s, d.waiting_timeout_s, d.heartbeat_interval_s) <= 0:
        problems.append("disagg timeouts and --heartbeat-interval-s must be > 0")
    if not 0 <= d.kv_port < 65536:
        problems.append("--kv-port must be in 0..65535 (0: any free port)")
    if not (0 if args.role == "decode" else 1) <= d.bootstrap_port < 65536:
        problems.append("--bootstrap-port must be in 1..65535 (a decode's may be 0: any free "
                        "port, which it names when it moves a stream)")
    try:
        load_cluster_key(d.cluster_key_file)
        ApiKeys.load(args.api_key, args.api_key_file, admin=args.admin_api_key)
    except ValueError as e:  # (KeyProblem too)
        problems.append(str(e))
    return problems


def _check_canary(c: CanaryConfig, sampler_backend: str) -> list[str]:
    problems = [] if c.kv_canary_sweep >= 1 else ["--kv-canary-sweep must be >= 1"]
    try:
        kinds = parse_perturb(c.perturb)
    except ValueError as e:
        return [*problems, str(e)]
    if kinds and not c.enabled:
        problems.append("--perturb injects faults for the KV canary to catch: it needs "
                        "--kv-canary log or raise")
    problems += uncatchable(kinds, c.kv_canary_bytes, sampler_backend)
    if c.kv_canary_bytes != "none" and not c.enabled:
        problems.append("--kv-canary-bytes needs --kv-canary log or raise")
    return problems
