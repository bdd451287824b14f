"""`--kv-canary-bytes partial` through PD (a real prefill + decode pair on loopback, tcp, the
token oracle on both sides, `raise`): the prefill corrupts one element of the last prompt page
before sending it (`kv_before_send`, in a layer drawn at random) and the decode checks the bytes
that landed against the checksums that left, which under `partial` cover the first and last
layers only (runtime/canary/kvsum.py). So what it guarantees depends on the model's depth:

- two layers (the tiny Llama): the first and last are every layer, and every fault is caught:
  injected (the prefill's /metrics) == caught (the decode's answers), over >= 20 of them;
- three layers: a fault in the middle layer goes unseen, by design: fewer are caught than
  injected (but some are), and an unseen one's request answers as if nothing happened.

Every request not caught returns its oracle sequence, nothing is caught that was not injected,
and both pools come back empty.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.canary.test_pd_canary import (
    bodies_for,
    caught_or_exact,
    injections,
    oracle_wants,
    run,
    wait_empty,
)
from tests.disagg.pd import Pair, start_pair, tiny_model
from tests.server.test_metrics import metric

PARTIAL = ("--sampler-backend", "token_oracle", "--kv-canary", "raise", "--kv-canary-bytes",
           "partial", "--page-size", "4", "--max-running-requests", "128")
N_REQS = 56


@pytest.fixture(scope="module", params=[2, 3], ids=["2-layers", "3-layers"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Pair, int]]:
    from tests.gpu.conftest import model_files

    layers = request.param
    model = tiny_model(model_files(), tmp_path_factory.mktemp(f"tiny-{layers}"), layers=layers)
    p = start_pair(tmp_path_factory.mktemp(f"pd-partial-{layers}"), "tcp", *PARTIAL,
                   model=str(model),
                   prefill_extra=("--perturb", "kv_before_send=0.5", "--perturb-seed", "3"))
    yield p, layers
    p.stop()


def test_partial_catches_what_lands_in_the_first_or_last_layer(pair: tuple[Pair, int]) -> None:
    p, layers = pair
    bodies = bodies_for(p, N_REQS, seed=5)
    caught = caught_or_exact(asyncio.run(run(p, bodies)), oracle_wants(bodies),
                             "KV bytes changed in transfer")
    wait_empty(p)
    sent = injections(p.prefill.url)
    assert set(sent) == {"kv_before_send"} and sent["kv_before_send"] >= 20, sent
    text = httpx.get(f"{p.decode.url}/metrics").text
    assert metric(text, "baton_kv_canary_violations_total", '{kind="bytes"}') == caught
    assert metric(text, "baton_kv_canary_violations_total", '{kind="tag"}') == 0
    if layers == 2:  # the first and last layers are all there is
        assert caught == sent["kv_before_send"]
    else:  # the middle layer's faults pass unseen
        assert 0 < caught < sent["kv_before_send"], (caught, sent)
