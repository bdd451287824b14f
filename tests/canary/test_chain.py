"""The token chain: a plain-Python reference, the segmented batch form, and the request's
growing chain agree; tags name tokens and positions, not requests."""

from __future__ import annotations

import random

import torch

from runtime.canary.chain import ReqChain, chain, segmented_chain
from runtime.canary.oracle import GOLDEN, MASK64, _signed

C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def ref_tags(tokens: list[int]) -> list[int]:
    """The chain in plain Python ints, from the module docstring's formula."""
    out, total = [], 0
    for pos, tok in enumerate(tokens):
        z = (((pos << 32) | tok) + GOLDEN) & MASK64
        z = ((z ^ (z >> 30)) * C1) & MASK64
        z = ((z ^ (z >> 27)) * C2) & MASK64
        total = (total + (z ^ (z >> 31))) & MASK64
        out.append(_signed(total))
    return out


def test_the_torch_chain_matches_the_reference() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(300)]
    assert chain(0, torch.tensor(tokens), 0).tolist() == ref_tags(tokens)
    tail = chain(ref_tags(tokens[:100])[-1], torch.tensor(tokens[100:]), 100)
    assert tail.tolist() == ref_tags(tokens)[100:]


def test_tags_name_the_token_prefix() -> None:
    a = ref_tags([5, 6, 7, 8])
    assert ref_tags([5, 6, 9, 8])[:2] == a[:2]  # a shared prefix shares its tags
    assert ref_tags([5, 6, 9, 8])[2:] != a[2:]  # and everything after a difference differs
    assert ref_tags([6, 5, 7, 8])[:2] != a[:2]  # order matters
    assert len(set(a)) == 4


def test_segmented_chain_is_each_segment_after_its_prefix() -> None:
    rng = random.Random(1)
    seqs = [[rng.randrange(1000) for _ in range(n)] for n in (7, 4, 30, 2)]
    starts = [0, 3, 10, 1]  # tokens already tagged in each
    tokens = torch.tensor([t for s, st in zip(seqs, starts, strict=True) for t in s[st:]])
    positions = torch.tensor([p for s, st in zip(seqs, starts, strict=True)
                              for p in range(st, len(s))])
    prev = torch.tensor([ref_tags(s)[st - 1] if st else 0 for s, st in zip(seqs, starts, strict=True)])
    lens = torch.tensor([len(s) - st for s, st in zip(seqs, starts, strict=True)])
    want = [t for s, st in zip(seqs, starts, strict=True) for t in ref_tags(s)[st:]]
    assert segmented_chain(prev, tokens, positions, lens).tolist() == want


def test_a_request_chain_grows_by_its_new_tokens() -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(1000) for _ in range(9)]
    output: list[int] = []
    rc = ReqChain()
    assert rc.cover(prompt, output).tolist() == ref_tags(prompt)
    for _ in range(40):
        output.append(rng.randrange(1000))
        assert rc.cover(prompt, output).tolist() == ref_tags(prompt + output)
    assert rc.n == 49 and len(rc.buf) >= 49
