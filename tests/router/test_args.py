"""`baton router` flags: what the operator renders parses as meant; bad flags exit 2."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from baton_operator.builders import build_deployment
from baton_operator.spec import parse_service

from runtime.router.args import parse_router_args
from runtime.router.config import DnsName, RouterConfig, WorkerAddress

UID = "6a1f0c7e-0000-4000-8000-000000000001"


def operator_router_argv(**spec: Any) -> list[str]:
    """The router container's command line in the operator's Deployment."""
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    svc = parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": UID,
                                      "generation": 1}, "spec": spec})
    [container] = build_deployment(svc, "router")["spec"]["template"]["spec"]["containers"]
    argv = container["command"] + container["args"]
    assert argv[:2] == ["baton", "router"]
    return argv[2:]  # type: ignore[no-any-return]


def test_the_operators_router_args_parse_as_meant() -> None:
    config = parse_router_args(operator_router_argv())
    assert (config.host, config.port, config.policy) == ("0.0.0.0", 8000, "cache_aware")
    assert config.tokenizer == "builtin:smollm2-135m"  # baked into the image
    assert (config.discovery, config.namespace) == ("kubernetes", "ml")
    assert config.prefill_selector == (
        "app.kubernetes.io/name=baton,app.kubernetes.io/instance=llm,baton.dev/role=prefill")
    assert config.decode_selector.endswith(",baton.dev/role=decode")
    assert config.prefill == config.decode == () and config.prefill_dns is None


def test_the_operators_dns_fallback_args_parse_as_meant() -> None:
    config = parse_router_args(operator_router_argv(router={"discovery": "dns"}))
    assert config.discovery == "flags"
    assert config.prefill_dns == DnsName("llm-prefill.ml.svc.cluster.local", 8000, 8998)
    assert config.decode_dns == DnsName("llm-decode.ml.svc.cluster.local", 8000)
    assert config.prefill == config.decode == ()


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware", "prefix"])
def test_every_policy_and_extra_args_from_the_spec_parse(policy: str) -> None:
    argv = operator_router_argv(router={"policy": policy, "args": [
        "--log-level", "debug", "--request-timeout-s", "120"]})
    config = parse_router_args(argv)
    assert (config.policy, config.log_level, config.request_timeout_s) == (policy, "debug", 120)


@pytest.mark.parametrize("argv", [
    ["--discovery", "kubernetes", "--decode-selector", "a=b"],
    ["--discovery", "kubernetes", "--prefill-selector", "a=b,", "--decode-selector", "a=b"],
    ["--discovery", "kubernetes", "--prefill-selector", "a=b", "--decode-selector", "a=b",
     "--decode", "http://10.0.0.3:30001"],
])
def test_kubernetes_discovery_needs_both_selectors_and_nothing_else(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_router_args(argv)
    assert exit_info.value.code == 2
    assert "--discovery kubernetes" in capsys.readouterr().err


def test_static_workers_and_defaults() -> None:
    config = parse_router_args([
        "--prefill", "http://10.0.0.1:30000", "--prefill", "http://10.0.0.2:30000,9001",
        "--decode", "http://10.0.0.3:30001/", "--decode", "https://[fd00::4]:30001"])
    assert config.prefill == (WorkerAddress("http://10.0.0.1:30000", 8998),
                              WorkerAddress("http://10.0.0.2:30000", 9001))
    assert config.decode == (WorkerAddress("http://10.0.0.3:30001"),
                             WorkerAddress("https://[fd00::4]:30001"))
    defaults = RouterConfig()
    assert (config.host, config.port, config.policy) == (defaults.host, 8000, "round_robin")
    assert config.request_timeout_s == defaults.request_timeout_s
    assert config.planner_window_s == 60
    assert parse_router_args(["--prefill", "http://p:1", "--decode", "http://d:1",
                              "--planner-window-s", "300"]).planner_window_s == 300
    assert parse_router_args(["--prefill-dns", "[fd00::1]:80:81", "--decode-dns", "d:82"]
                             ).prefill_dns == DnsName("fd00::1", 80, 81)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "no prefill workers"),
    (["--prefill", "http://p:1"], "no decode workers"),
    (["--prefill", "p:1", "--decode", "http://d:1"], "expected http://HOST:PORT"),
    (["--prefill", "http://p:1/v1", "--decode", "http://d:1"], "without a path"),
    (["--prefill", "http://p:1,x", "--decode", "http://d:1"], "bootstrap port 'x'"),
    (["--prefill", "http://p:1,70000", "--decode", "http://d:1"], "not in 1-65535"),
    (["--prefill", "http://p:99999", "--decode", "http://d:1"], "out of range"),
    (["--prefill-dns", "p:1", "--decode", "http://d:1"], "HOST:PORT:BOOTSTRAP_PORT"),
    (["--prefill-dns", ":1:2", "--decode", "http://d:1"], "empty host"),
    (["--prefill", "http://p:1", "--decode-dns", "d"], "expected HOST:PORT"),
    (["--prefill", "http://p:1", "--prefill-dns", "p:1:2", "--decode", "http://d:1"],
     "not both"),
    (["--prefill", "http://p:1", "--decode", "http://d:1", "--policy", "random"],
     "invalid choice"),
    (["--prefill", "http://p:1", "--decode", "http://d:1", "--health-interval-s", "0"],
     "must be a finite number > 0"),
    (["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "0"], "not in 1-65535"),
])
def test_bad_flags_are_argparse_errors(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_router_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_router_imports_no_torch() -> None:
    code = ("import sys, runtime.cli, runtime.router.main, runtime.router.app; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(("
            "'runtime.engine', 'runtime.models', 'runtime.scheduler', 'runtime.server'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
