"""Fuzz the server's OpenAPI spec with schemathesis: positive and negative cases for every
operation. Nothing may be a 5xx, every error is our JSON shape, and the server keeps serving.
Then what a schema cannot describe (issue 12): a lone UTF-16 surrogate or a non-finite number
(NaN, Infinity, 1e999) in any field, key or nesting of valid bodies is a 400 naming the field,
on a connection that stays open. Bounded and deterministic: a fixed number of examples,
derandomized."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.sampling_params import SamplingParams
from tests.server.hostile_cases import HOSTILE_SETTINGS, check_hostile, hostile_bodies
from tests.server.server_process import ServerProcess

# examples per operation: a positive case runs the real model, a negative one is refused at once
EXAMPLES = {"positive": 5, "negative": 12}
KNOWN_PARAMS = {f.name for f in dataclasses.fields(SamplingParams)}
GEN_CAP = 3  # generated tokens per fuzzed request: keep the fuzz fast
CALL_TIMEOUT_S = 60


def _cap(body: dict[str, Any], key: str, limit: int, default: bool) -> None:
    value = body.get(key)  # JSON numbers: 3000.0 is an integer too
    too_big = isinstance(value, int | float) and not isinstance(value, bool) and value > limit
    if too_big or (value is None and default):
        body[key] = limit


def _bound(path: str, body: Any, positive: bool) -> None:
    """Keep valid requests short; invalid values stay as generated. Positive cases name the
    served model and only known sampling parameters, so they reach the scheduler."""
    if not isinstance(body, dict):
        return
    if positive and "model" in body:
        body["model"] = "smollm2"
    if path in ("/v1/completions", "/v1/chat/completions"):
        has_new = body.get("max_completion_tokens") is not None
        _cap(body, "max_tokens", GEN_CAP, default=not has_new)
        _cap(body, "max_completion_tokens", GEN_CAP, default=False)
        _cap(body, "n", 2, default=False)
    elif path == "/generate":
        sp = body.get("sampling_params")
        if sp is None and positive:
            body["sampling_params"] = sp = {}
        if isinstance(sp, dict):
            if positive:
                for key in set(sp) - KNOWN_PARAMS:
                    del sp[key]
            _cap(sp, "max_new_tokens", GEN_CAP, default=True)


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# a valid GET /kv_events is an event stream that stays open (60 s of this fuzz went to one such
# call waiting out its timeout): fuzzed negative only; tests/server/test_kv_events.py reads it
STREAMS = {"/kv_events"}


def _operations(schema: Any, mode: schemathesis.GenerationMode) -> list[Any]:
    ops = [result.ok() for result in schema.get_all_operations()]
    if mode == schemathesis.GenerationMode.POSITIVE:
        ops = [op for op in ops if op.path not in STREAMS]
    return ops


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_fuzz_openapi(server: ServerProcess, schema: Any, mode: schemathesis.GenerationMode) -> None:
    ops = _operations(schema, mode)
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/generate", "/abort"}
    failures: list[str] = []
    strategy = st.one_of(*(op.as_strategy(generation_mode=mode) for op in ops))

    @settings(max_examples=EXAMPLES[mode.value] * len(ops), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(case=strategy)
    def run(case: Any) -> None:
        _bound(case.path, case.body, mode == schemathesis.GenerationMode.POSITIVE)
        try:
            response = case.call(base_url=server.url, timeout=CALL_TIMEOUT_S)
        except requests.RequestException as e:  # a hang or a dropped connection is a finding
            failures.append(f"{case.method} {case.path} {str(case.body)[:300]!r}: {e!r}")
            return
        where = f"{case.method} {case.path} {str(case.body)[:300]!r} -> {response.status_code}"
        if response.status_code >= 500:
            failures.append(f"{where}: {response.text[:300]}")
        elif response.status_code >= 400:
            err = response.json().get("error", {})
            if not {"message", "type", "code"} <= set(err):
                failures.append(f"{where}: not an error body: {response.text[:300]}")

    run()
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_surrogates_and_non_finite_numbers_anywhere_are_a_400(client: httpx.Client) -> None:
    @HOSTILE_SETTINGS
    @given(case=hostile_bodies())
    def run(case: tuple[str, bytes, str, str]) -> None:
        check_hostile(client, *case)

    run()
    assert client.get("/health").status_code == 200
