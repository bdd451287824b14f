"""A prefix cache per tenant (issue #34, item 5): behind a router with two API keys, tenant B
guessing tenant A's prompt learns nothing from the cache. Its guess reports no cached tokens and
takes as long as a prompt nobody sent, over 10 trials, while A's own repeat is served from the
cache; a `cache_salt` the client sends splits its own requests further. Real processes: a
router (cache_aware, with the tokenizer) in front of a prefill and a decode (tiny Llama, tcp)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.test_pd_retry import Deployment, deploy

A, B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike"]
TRIALS = 10


@pytest.fixture(scope="module")
def dep(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    roomy = ("--max-total-tokens", "16384")
    d = deploy(tiny_path, tmp_path_factory.mktemp("tenants"), 1, 1, roomy, roomy,
               router_args=("--api-key", A, "--api-key", B, "--policy", "cache_aware",
                            "--tokenizer", str(tiny_path)))
    yield d
    d.stop()


def secret(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(2000))  # ~3200 tokens


def ask(http: httpx.Client, url: str, key: str, prompt: str, **extra: Any) -> tuple[int, float]:
    """(cached prompt tokens, seconds) of a one-token completion."""
    began = time.monotonic()
    r = http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                  json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    took = time.monotonic() - began
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], took


def test_a_tenant_cannot_tell_what_another_one_sent(dep: Deployment) -> None:
    url, rng = dep.router.url, random.Random(7)
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {A}"}).json()
    name = model["data"][0]["id"]
    own, guess, control = [], [], []
    with httpx.Client(timeout=120) as http:
        def completion(key: str, prompt: str, **extra: Any) -> tuple[int, float]:
            return ask(http, url, key, prompt, model=name, **extra)

        completion(A, secret(rng))  # warm-up
        for _ in range(TRIALS):
            text = secret(rng)
            completion(A, text)  # A's prompt, now in the cache
            own.append(completion(A, text))
            guess.append(completion(B, text))  # B guesses it exactly
            control.append(completion(B, secret(rng)))  # a prompt nobody sent
        # a client's own cache_salt splits its requests further: A under another salt
        text = secret(rng)
        completion(A, text)
        assert completion(A, text, cache_salt="project-2")[0] == 0
        assert completion(A, text, cache_salt="project-2")[0] > 0
    assert all(cached > 0 for cached, _ in own), own
    assert [cached for cached, _ in guess] == [0] * TRIALS, guess
    t_own, t_guess, t_control = (statistics.median(t for _, t in runs)
                                 for runs in (own, guess, control))
    print(f"median latency: A's repeat {t_own * 1000:.0f} ms, B's guess {t_guess * 1000:.0f} ms, "
          f"a prompt nobody sent {t_control * 1000:.0f} ms")
    assert 0.7 < t_guess / t_control < 1.4, (t_guess, t_control)  # no timing gap
