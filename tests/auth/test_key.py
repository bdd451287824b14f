"""The cluster key: where it comes from, what a bad one says, and that MACs are bound to their
purpose and parts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.auth.key import ClusterKey, KeyProblem, ReplayCache, load_cluster_key
from runtime.auth.ticket import TicketGate, TicketRefused, sign
from runtime.protocol import prompt_digest


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
    a, b = prompt_digest({"text": "prompt A"}), prompt_digest({"text": "prompt B"})
    token = sign(k, [5, 6], "rid", "P", "10.0.0.1", 8998, "D", a, ttl_s=60)
    gate = TicketGate(k, "decode")
    with pytest.raises(TicketRefused, match="cover this request's prompt"):
        gate.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "D", b)
    gate.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "D", a)
    with pytest.raises(TicketRefused, match="used before"):
        gate.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "D", a)
    fresh = TicketGate(k, "prefill")
    with pytest.raises(TicketRefused, match="expired"):
        fresh.admit(token, [5, 6], "rid", "10.0.0.1", 8998, "P", a, now=10**10)
    with pytest.raises(TicketRefused, match="bootstrap_room, bootstrap_host"):
        fresh.admit(token, [6, 5], "rid", "10.0.0.2", 8998, "P", a)
    TicketGate(ClusterKey.none(), "decode").admit(None, [1], None, None, None, None, b)  # no key


def test_the_prompt_digest_sees_every_prompt_field_and_the_resume() -> None:
    base = prompt_digest({"input_ids": [1, 2, 3]})
    assert base == prompt_digest({"input_ids": [1, 2, 3], "text": None, "sampling_params": {"x": 1}})
    others = [{"input_ids": [1, 2, 4]}, {"text": "[1, 2, 3]"}, {"prompt": [1, 2, 3]},
              {"input_ids": [1, 2, 3], "resume": {"output_ids": [9], "text_chars": 1}},
              {"messages": [{"role": "user", "content": "hi"}]}]
    assert len({base, *(prompt_digest(o) for o in others)}) == 1 + len(others)


def test_serve_and_router_refuse_a_bad_key_file_at_start(tmp_path: Path) -> None:
    short = tmp_path / "key"
    short.write_text("tiny")
    for cmd in (["serve", "--role", "decode"], ["router", "--prefill", "http://p:1",
                                                 "--decode", "http://d:1"]):
        out = subprocess.run([sys.executable, "-m", "runtime.cli", *cmd, "--cluster-key-file",
                              str(short)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "the cluster key has 4 bytes" in out.stderr, out.stderr
