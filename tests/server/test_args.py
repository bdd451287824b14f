"""`baton serve` flags come from ServerArgs: same names, same defaults."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import CanaryConfig, DisaggConfig, EngineConfig, SchedulerConfig, ServerArgs
from runtime.server.args import build_parser, parse_server_args


def test_defaults_come_from_the_dataclass() -> None:
    assert dataclasses.replace(parse_server_args([]), revision=None) == ServerArgs()
    flags = {a.dest for a in build_parser()._actions}
    names = {f.name for cls in (ServerArgs, EngineConfig, SchedulerConfig, DisaggConfig,
                                CanaryConfig)
             for f in dataclasses.fields(cls)} - {"engine", "scheduler", "disagg", "canary"}
    assert names <= flags


def test_timeouts_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_BOOTSTRAP_TIMEOUT_S", "7.5")
    monkeypatch.setenv("BATON_HEARTBEAT_MISSES", "4")
    args = parse_server_args(["--heartbeat-misses", "3"])
    assert (args.disagg.bootstrap_timeout_s, args.disagg.heartbeat_misses) == (7.5, 3)


def test_cli_contract_flags() -> None:
    args = parse_server_args([
        "--model", "/m", "--role", "decode", "--host", "0.0.0.0", "--port", "9000",
        "--bootstrap-port", "9001", "--kv-transfer", "tcp", "--served-model-name", "x",
        "--max-running-requests", "4", "--max-total-tokens", "1024", "--no-enable-overlap",
        "--plugin", "a.b", "--plugin", "c", "--sampler-backend", "mirror",
    ])
    assert (args.model, args.role, args.port, args.model_name) == ("/m", "decode", 9000, "x")
    assert (args.disagg.kv_transfer, args.disagg.bootstrap_port) == ("tcp", 9001)
    assert args.plugin == ("a.b", "c") and not args.scheduler.enable_overlap
    assert args.engine.sampler_backend == "mirror" and args.engine.max_total_tokens == 1024
    assert args.scheduler.max_running_requests == 4


@pytest.mark.parametrize(("argv", "cpu", "cuda"), [
    ([], False, True), (["--enable-overlap"], True, True), (["--no-enable-overlap"], False, False)])
def test_overlap_defaults_on_for_a_gpu_and_off_for_a_cpu(argv: list[str], cpu: bool,
                                                         cuda: bool) -> None:
    sched = parse_server_args(argv).scheduler
    assert (sched.overlaps("cpu"), sched.overlaps("cuda")) == (cpu, cuda)


@pytest.mark.parametrize("argv", [
    ["--role", "router"], ["--port", "0"], ["--stream-interval", "0"],
    ["--device", "cuda", "--mem-fraction-static", "1.2"],
    ["--mem-fraction-static", "0.8"],  # the CPU pool is sized by --max-total-tokens
    ["--role", "prefill", "--bootstrap-port", "0"],  # the router must know a prefill's
    ["--role", "decode", "--bootstrap-port", "70000"],
])
def test_bad_values_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2


def test_a_decode_may_offer_moved_kv_on_any_free_port() -> None:
    args = parse_server_args(["--role", "decode", "--move-kv-on-drain", "--bootstrap-port", "0"])
    assert args.disagg.move_kv_on_drain and args.disagg.bootstrap_port == 0


def test_mem_fraction_static_is_a_gpu_flag() -> None:
    args = parse_server_args(["--device", "cuda", "--mem-fraction-static", "0.85"])
    assert args.engine.mem_fraction_static == 0.85


def test_canary_flags_are_checked() -> None:
    args = parse_server_args(["--kv-canary", "raise", "--kv-canary-sweep", "4",
                              "--perturb", "wrong_slots=0.5,req_to_token=0.1"])
    assert args.canary == CanaryConfig(kv_canary="raise", kv_canary_sweep=4,
                                       perturb="wrong_slots=0.5,req_to_token=0.1")
    for bad in (["--perturb", "wrong_slots=0.5"],  # nothing would catch them
                ["--kv-canary", "log", "--perturb", "bogus=0.1"],
                ["--kv-canary", "log", "--perturb", "wrong_slots=2"],
                ["--kv-canary", "log", "--kv-canary-sweep", "0"],
                ["--kv-canary-bytes", "all"]):
        with pytest.raises(SystemExit):
            parse_server_args(bad)


@pytest.mark.parametrize(("kind", "needs"), [
    ("kv_before_send", ["--kv-canary-bytes", "partial"]),
    ("kv_after_forward", ["--kv-canary-bytes", "all"]),
    ("next_token_swap", ["--sampler-backend", "token_oracle"])])
def test_a_fault_the_canary_cannot_catch_is_refused(
        kind: str, needs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--kv-canary", "log", "--perturb", f"{kind}=0.1"]
    with pytest.raises(SystemExit):
        parse_server_args(flags)
    err = capsys.readouterr().err
    assert f"--perturb {kind}" in err and needs[0] in err, err
    assert parse_server_args([*flags, *needs]).canary.perturb == f"{kind}=0.1"


@pytest.mark.parametrize(("argv", "says"), [
    (["--quantization", "fp8"], "--quantization fp8 needs --device cuda"),
    (["--device", "cuda", "--quantization", "int4"], "--quantization int4 is a CPU mode")])
def test_a_quantization_for_the_other_device_exits_2(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert parse_server_args(["--device", "cuda", "--quantization", "fp8"]).engine.quantization == "fp8"


def test_a_revision_from_the_flag_the_environment_or_what_the_worker_computes_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime/revision.py: --revision, else $BATON_REVISION, else a digest of what changes the
    computed tokens (the same for a prefill and a decode of one model and TP sizes apart)."""
    monkeypatch.delenv("BATON_REVISION", raising=False)
    assert parse_server_args(["--revision", "rev-7"]).revision == "rev-7"
    prefill = parse_server_args(["--role", "prefill", "--tp", "2", "--kv-transfer", "tcp",
                                 "--port", "9000"]).revision
    decode = parse_server_args(["--role", "decode", "--max-total-tokens", "64"]).revision
    assert prefill == decode and prefill is not None and len(prefill) == 12
    for other in (["--dtype", "bfloat16"], ["--quantization", "int4"], ["--model", "/m"],
                  ["--kv-cache-dtype", "fp8_e4m3"]):
        assert parse_server_args(other).revision != prefill, other
    monkeypatch.setenv("BATON_REVISION", "from-env")
    assert parse_server_args([]).revision == "from-env"
    assert parse_server_args(["--revision", "flag"]).revision == "flag"
    for bad in ("a b", "x" * 65, "rev/1"):
        with pytest.raises(SystemExit) as e:
            parse_server_args(["--revision", bad])
        assert e.value.code == 2, bad
