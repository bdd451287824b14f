"""Bad arguments raise a clear error naming the field; the engine keeps working afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime import Engine
from runtime.sampling_params import InvalidRequest


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine(max_total_tokens=2048)
    yield e
    e.shutdown()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"max_tokens": 5}, "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(engine: Engine, params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        engine.generate(["hi"], params)
    assert e.value.field == field
    assert field in str(e.value)


def test_prompt_longer_than_context(engine: Engine) -> None:
    too_long = [1] * (engine.runner.context_len + 5)
    with pytest.raises(InvalidRequest, match="context") as e:
        engine.generate([too_long], {"max_new_tokens": 1})
    assert e.value.field == "prompt"


def test_out_of_vocab_ids_and_mismatched_params(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.generate([[1, 2, 10**9]], {"max_new_tokens": 1})
    with pytest.raises(InvalidRequest, match="sampling_params"):
        engine.generate(["a", "b"], [{"max_new_tokens": 1}])


def test_a_bad_request_in_a_batch_runs_nothing_and_engine_still_works(engine: Engine) -> None:
    with pytest.raises(InvalidRequest):
        engine.generate(["fine", [1] * (engine.runner.context_len + 1)], {"max_new_tokens": 2})
    assert not engine.scheduler.has_work()
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 3})
    assert out["meta_info"]["completion_tokens"] == 3
    assert engine.runner.kv.is_all_free()


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="max_total_tokenz"):
        Engine(max_total_tokenz=10)
