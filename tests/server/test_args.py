"""`baton serve` flags come from ServerArgs: same names, same defaults."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import ServerArgs
from runtime.server.args import build_parser, parse_server_args


def test_defaults_come_from_the_dataclass() -> None:
    assert parse_server_args([]) == ServerArgs()
    flags = {a.dest for a in build_parser()._actions}
    assert {f.name for f in dataclasses.fields(ServerArgs)} <= flags


def test_cli_contract_flags() -> None:
    args = parse_server_args([
        "--model", "/m", "--role", "decode", "--host", "0.0.0.0", "--port", "9000",
        "--bootstrap-port", "9001", "--kv-transfer", "tcp", "--served-model-name", "x",
        "--max-running-requests", "4", "--max-total-tokens", "1024", "--no-enable-overlap",
        "--plugin", "a.b", "--plugin", "c", "--sampler-backend", "mirror",
    ])
    assert (args.model, args.role, args.port, args.kv_transfer, args.model_name) == ("/m", "decode", 9000, "tcp", "x")
    assert args.plugin == ("a.b", "c") and not args.enable_overlap
    assert args.engine_config().sampler_backend == "mirror"
    assert args.scheduler_config().max_running_requests == 4


@pytest.mark.parametrize("argv", [["--role", "router"], ["--port", "0"], ["--stream-interval", "0"]])
def test_bad_values_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
