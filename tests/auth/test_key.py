"""The cluster key: where it comes from, what a bad one says, and that MACs are bound to their
purpose and parts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.auth.key import ClusterKey, KeyProblem, ReplayCache, load_cluster_key
from runtime.auth.ticket import TicketGate, TicketRefused, sign


def test_file_wins_over_env_and_short_or_missing_keys_are_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_text("f" * 64 + "\n")
    assert load_cluster_key(str(good), {"BATON_CLUSTER_KEY": "e" * 64}) == ClusterKey(b"f" * 64)
    assert load_cluster_key(None, {"BATON_CLUSTER_KEY": "e" * 64}) == ClusterKey(b"e" * 64)
    assert not load_cluster_key(None, {}).enabled
    with pytest.raises(KeyProblem, match="16 random bytes"):
        load_cluster_key(None, {"BATON_CLUSTER_KEY": "short"})
    with pytest.raises(KeyProblem, match=r"--cluster-key-file .*No such file"):
        load_cluster_key(str(tmp_path / "nope"), {})
    assert "f" * 8 not in repr(load_cluster_key(str(good), {}))  # never in logs


def test_macs_are_bound_to_purpose_and_part_boundaries() -> None:
    k = ClusterKey(b"k" * 32)
    assert k.mac("a", "xy", "z") != k.mac("a", "x", "yz")
    assert k.mac("a", "x") != k.mac("b", "x")
    assert k.verify(k.mac("a", b"x"), "a", "x") and not k.verify(b"0" * 32, "a", "x")


def test_replay_cache_takes_a_token_once_and_forgets_it_when_expired() -> None:
    cache = ReplayCache(most=2048)
    assert cache.first_use(b"t", expires=10.0, now=0.0)
    assert not cache.first_use(b"t", expires=10.0, now=1.0)
    for i in range(1023):  # the 1024th entry prunes what expired
        cache.first_use(str(i).encode(), expires=5.0, now=1.0)
    assert cache.first_use(b"t", expires=30.0, now=20.0)


def test_gate_checks_deadline_fields_and_side() -> None:
    k = ClusterKey(b"k" * 32)
    token = sign(k, [5, 6], "rid", "P", "10.0.0.1", 8998, "D", ttl_s=60)
    gate = TicketGate(k, "decode")
    gate.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "D")
    with pytest.raises(TicketRefused, match="used before"):
        gate.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "D")
    fresh = TicketGate(k, "prefill")
    with pytest.raises(TicketRefused, match="expired"):
        fresh.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "P", now=10**10)
    with pytest.raises(TicketRefused, match="bootstrap_room, bootstrap_host"):
        fresh.admit(token, [6, 5], "rid", "10.0.0.2", 8998, "P")
    TicketGate(ClusterKey.none(), "decode").admit(None, [1], None, None, None, None)  # no key


def test_serve_and_router_refuse_a_bad_key_file_at_start(tmp_path: Path) -> None:
    short = tmp_path / "key"
    short.write_text("tiny")
    for cmd in (["serve", "--role", "decode"], ["router", "--prefill", "http://p:1",
                                                 "--decode", "http://d:1"]):
        out = subprocess.run([sys.executable, "-m", "runtime.cli", *cmd, "--cluster-key-file",
                              str(short)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "the cluster key has 4 bytes" in out.stderr, out.stderr
