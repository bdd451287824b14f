"""Request identity and the token oracle (seed 002): formulas, torch == Python, and the engine."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import torch

from runtime import Engine
from runtime.canary.identity import NO_ROOM, rid_to_int64, rids_to_tensor, rooms_to_tensor
from runtime.canary.oracle import (
    MASK64,
    identities,
    oracle_sequence,
    oracle_token,
    oracle_tokens,
    splitmix64,
)
from runtime.engine.sampler import uniform_from_seed


def test_rid_hash_is_blake2b_8_bytes_little_endian_signed() -> None:
    for rid in ["a", "req-1", "ünïcode", "x" * 300]:
        digest = hashlib.blake2b(rid.encode(), digest_size=8).digest()
        assert rid_to_int64(rid) == struct.unpack("<q", digest)[0]
    assert rids_to_tensor(["a", "b"]).dtype == torch.int64
    assert rooms_to_tensor([5, None, 0]).tolist() == [5, NO_ROOM, 0]


def test_splitmix64_reference_values() -> None:
    # First outputs of splitmix64 seeded with 0 (the generator's published test vector).
    state, outs = 0, []
    for _ in range(3):
        outs.append(splitmix64(state))
        state = (state + 0x9E3779B97F4A7C15) & MASK64
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@pytest.mark.parametrize("vocab", [2, 1000, 49152, 151_936])
def test_torch_oracle_equals_python(vocab: int) -> None:
    rng = random.Random(vocab)
    ids = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(500)] + [0, -1, (1 << 63) - 1]
    pos = [rng.randrange(0, 1 << 20) for _ in ids]
    got = oracle_tokens(torch.tensor(ids), torch.tensor(pos), vocab).tolist()
    assert got == [oracle_token(i, p, vocab) for i, p in zip(ids, pos, strict=True)]
    assert all(0 <= t < vocab for t in got)


def test_identity_is_the_room_when_there_is_one() -> None:
    rids, rooms = torch.tensor([11, 22, 33]), torch.tensor([-1, 7, 0])
    assert identities(rids, rooms).tolist() == [11, 7, 0]


def test_uniform_from_seed_matches_a_python_reference() -> None:
    def reference(seed: int, pos: int) -> float:
        z = (seed * 0x9E3779B97F4A7C15 + pos) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53

    seeds, pos = [0, 1, -5, 1234, (1 << 62) + 3], [0, 7, 100, 5, 1 << 20]
    got = uniform_from_seed(torch.tensor(seeds), torch.tensor(pos)).tolist()
    assert got == [reference(s, p) for s, p in zip(seeds, pos, strict=True)]


def test_engine_with_the_token_oracle_returns_the_oracle_sequence(model_path: object) -> None:
    with Engine(max_total_tokens=2048, sampler_backend="token_oracle") as engine:
        prompts = ["Hello", "The capital of France is", "def f(x):\n    return"]
        outs = engine.generate(prompts, {"max_new_tokens": 12, "ignore_eos": True})
        vocab = engine.runner.vocab_size
        for out in outs:
            rid, n_prompt = out["meta_info"]["id"], out["meta_info"]["prompt_tokens"]
            want = oracle_sequence(rid_to_int64(rid), n_prompt, 12, vocab)
            assert out["output_ids"] == want
        assert engine.runner.kv.is_all_free()
