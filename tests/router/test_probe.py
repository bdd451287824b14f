"""The rollout gate's probes (issue 39, item 3; runtime/router/probe.py): `POST /debug/probe`
on a real router sends oracle requests through a named pair of real servers that run the token
oracle and the KV canary. A sound pair passes every probe with the oracle's exact tokens; a
prefill that corrupts the KV it sends (`--perturb kv_before_send`) fails the first probe, and
the verdict names it and the canary's finding; servers that cannot prove anything are refused."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from runtime.auth.key import ENV, ClusterKey
from runtime.router.probe import oracle_mismatch
from tests.ports import free_port
from tests.router.router_process import RouterProcess, start_router
from tests.server.server_process import ServerProcess

ADMIN = "probe-admin-key"
GATED = ("--kv-transfer", "tcp", "--sampler-backend", "token_oracle", "--kv-canary", "raise",
         "--kv-canary-bytes", "all")


@dataclass
class Pods:
    sound: ServerProcess  # a prefill
    sound_port: int
    corrupting: ServerProcess  # a prefill that negates an element of every page it sends
    corrupting_port: int
    decode: ServerProcess
    router: RouterProcess
    key: str  # the cluster key all of them share


@pytest.fixture(scope="module")
def pods(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    logs = tmp_path_factory.mktemp("probe")
    env = {ENV: secrets.token_hex(32)}
    ports = [free_port(), free_port()]
    procs = [ServerProcess("--role", "prefill", "--bootstrap-port", str(ports[0]), *GATED,
                           model=str(tiny_path), env=env, log_path=logs / "sound.log"),
             ServerProcess("--role", "prefill", "--bootstrap-port", str(ports[1]), *GATED,
                           "--perturb", "kv_before_send=1", "--perturb-warmup-steps", "0",
                           model=str(tiny_path), env=env, log_path=logs / "corrupting.log"),
             ServerProcess("--role", "decode", "--kv-port", "0", *GATED, model=str(tiny_path),
                           env=env, log_path=logs / "decode.log")]
    router = None
    try:
        for proc in procs:
            proc.wait_ready()
        # the router serves the sound pair; the probes name their pair, in its pools or not
        router = start_router("--prefill", f"{procs[0].url},{ports[0]}", "--decode", procs[2].url,
                              "--admin-api-key", ADMIN, log_path=logs / "router.log", env=env)
        yield Pods(procs[0], ports[0], procs[1], ports[1], procs[2], router, env[ENV])
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            if proc.proc.poll() is None:
                proc.stop()


def probe(pods: Pods, prefill: ServerProcess, port: int, decode: ServerProcess,
          **extra: object) -> httpx.Response:
    body = {"prefill": prefill.url, "bootstrap_port": port, "decode": decode.url, **extra}
    return httpx.post(f"{pods.router.url}/debug/probe", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {ADMIN}"})


def test_a_sound_pair_passes_every_probe_with_the_oracles_tokens(pods: Pods) -> None:
    r = probe(pods, pods.sound, pods.sound_port, pods.decode, prompt_tokens=[3, 17, 70],
              max_tokens=6)
    assert r.status_code == 200, r.text
    verdict = r.json()
    assert verdict["passed"] and verdict["failed"] is None, verdict
    assert [p["passed"] for p in verdict["probes"]] == [True] * 3, verdict
    assert verdict["probes"][2]["name"] == (
        f"probe 3: 70 prompt tokens, prefill {pods.sound.url} -> decode {pods.decode.url}")
    assert verdict["violations"] == {pods.sound.url: 0, pods.decode.url: 0}
    for srv in (pods.sound, pods.decode):
        assert httpx.get(f"{srv.url}/debug/stats").json()["kv_all_free"], srv.url


def test_a_prefill_that_corrupts_its_kv_fails_the_gate_and_is_named(pods: Pods) -> None:
    r = probe(pods, pods.corrupting, pods.corrupting_port, pods.decode)
    assert r.status_code == 200, r.text
    verdict = r.json()
    assert not verdict["passed"], verdict
    first = verdict["probes"][0]
    assert not first["passed"] and "KV canary" in first["why"], verdict
    assert verdict["failed"].startswith(
        f"probe 1: 5 prompt tokens, prefill {pods.corrupting.url} -> decode {pods.decode.url}: ")
    assert verdict["violations"][pods.decode.url] >= 1, verdict
    # the decode threw the corrupted KV away and serves the sound prefill as before
    assert httpx.get(f"{pods.decode.url}/debug/stats").json()["kv_all_free"]
    assert probe(pods, pods.sound, pods.sound_port, pods.decode).json()["passed"]
    # the router's gauges keep its pools' workers only (the corrupting prefill is not one)
    metrics = httpx.get(f"{pods.router.url}/metrics").text
    assert pods.sound.url in metrics and pods.corrupting.url not in metrics


def test_servers_that_cannot_prove_anything_are_refused(pods: Pods,
                                                        server: ServerProcess) -> None:
    """A server without the oracle and the canary (the session's colocated one), a decode named
    as the prefill, a body out of range: a 409 or 400 that says why, and no probe runs."""
    r = probe(pods, server, pods.sound_port, pods.decode)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert f"prefill {server.url} cannot be probed" in message
    assert "token_oracle sampler" in message and "KV canary" in message and "prefill role" in message
    r = probe(pods, pods.decode, pods.sound_port, pods.decode)
    assert r.status_code == 409 and "the prefill role" in r.text, r.text
    for bad in ({"max_tokens": 0}, {"prompt_tokens": []}, {"prompt_tokens": [0]},
                {"surprise": 1}):
        r = probe(pods, pods.sound, pods.sound_port, pods.decode, **bad)
        assert r.status_code == 400, (bad, r.text)


def test_only_the_admin_key_opens_it(pods: Pods, tmp_path: Path) -> None:
    """It sends requests where its body says: with no API keys the other debug views are open,
    this one needs the admin key, and a router without one refuses it and says how to set one."""
    body = {"prefill": pods.sound.url, "bootstrap_port": pods.sound_port, "decode": pods.decode.url}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{pods.router.url}/debug/probe", json=body, headers=headers, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
    assert httpx.get(f"{pods.router.url}/debug/pairs").status_code == 200  # open, no keys
    bare = start_router("--prefill", f"{pods.sound.url},{pods.sound_port}", "--decode",
                        pods.decode.url, log_path=tmp_path / "bare.log")
    try:
        r = httpx.post(f"{bare.url}/debug/probe", json=body, timeout=30)
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"], r.text
    finally:
        bare.stop()


def test_the_operators_token_from_the_cluster_key_opens_it(pods: Pods) -> None:
    """The operator holds the service's Secret, not the admin key: the token it derives from
    the cluster key is an admin credential; one derived from another key is not."""
    body = {"prefill": pods.sound.url, "bootstrap_port": pods.sound_port,
            "decode": pods.decode.url, "prompt_tokens": [4], "max_tokens": 2}
    token = ClusterKey(pods.key.encode()).operator_token()
    r = httpx.post(f"{pods.router.url}/debug/probe", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["passed"], r.text
    other = ClusterKey(b"another service's key, 32 bytes!").operator_token()
    r = httpx.post(f"{pods.router.url}/debug/probe", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 403, r.text
    assert ClusterKey.none().operator_token() is None  # no key, no token


def test_the_verdict_compares_every_token_with_the_oracles() -> None:
    assert oracle_mismatch({"output_ids": [5, 6, 7], "meta_info": {}}, [5, 6, 7]) is None
    assert oracle_mismatch({"output_ids": [5, 9, 7], "meta_info": {}}, [5, 6, 7]) == (
        "token 1 is 9, the oracle's is 6 (3 tokens, 3 wanted)")
    assert oracle_mismatch({"output_ids": [5, 6], "meta_info": {}}, [5, 6, 7]) == (
        "token 2 is missing, the oracle's is 7 (2 tokens, 3 wanted)")
    assert "aborted: KV canary" in str(oracle_mismatch(
        {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort",
                                                          "message": "KV canary: tag"}}}, [1]))
    assert "no output_ids" in str(oracle_mismatch({"text": "x"}, [1]))
