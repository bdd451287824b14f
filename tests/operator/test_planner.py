"""The P:D planner's queueing model (operator/baton_operator/planner.py) on synthetic rates: the
prefill's M/G/1 wait against a hand computation and against a simulation of the same queue,
the decode's Little's-law fixed point, each role's count following the load that is its own
(a prefill-heavy load raises the prefill count only, a decode-heavy one the decode count), the
bounds and the reasons, and `baton plan` on a JSON of figures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from baton_operator.planner import (
    Lengths,
    Load,
    Measured,
    Targets,
    decode_itl,
    figures_from,
    main,
    plan,
    prefill_ttft,
    step_line,
)

MEASURED = Measured(prefill_tokens_per_s=4000.0, decode_steps=((1, 0.010), (16, 0.016), (64, 0.040)))
TARGETS = Targets(ttft_s=2.0, itl_s=0.030, prefill=(1, 32), decode=(1, 32))


def test_the_prefill_wait_is_pollaczek_khinchine() -> None:
    """Fixed prompts of 1000 tokens at 4000 tokens/s: S = 0.25 s, M/D/1 per pod."""
    load = Load(6.0, Lengths.fixed(1000), Lengths.fixed(100))
    lam, s = 6.0 / 2, 0.25
    rho = lam * s
    assert prefill_ttft(2, load, 4000.0) == pytest.approx(s + lam * s * s / (2 * (1 - rho)))
    assert prefill_ttft(1, load, 4000.0) == float("inf")  # rho = 1.5


def test_the_prefill_model_matches_a_simulated_queue() -> None:
    """Poisson arrivals split at random over n FIFO pods, prompt lengths drawn from a mix of
    short and long: the simulated mean TTFT is within 5 % of the model's."""
    rng = random.Random(7)
    prompts = [rng.choice([200, 200, 200, 3000]) for _ in range(2000)]
    load = Load(9.0, Lengths.of(prompts), Lengths.fixed(50))
    n, mu = 3, 4000.0
    free_at, t, total, count = [0.0] * n, 0.0, 0.0, 60000
    for _ in range(count):
        t += rng.expovariate(load.rate)
        pod = rng.randrange(n)
        start = max(t, free_at[pod])
        free_at[pod] = start + rng.choice(prompts) / mu
        total += free_at[pod] - t
    assert total / count == pytest.approx(prefill_ttft(n, load, mu), rel=0.05)


def test_the_decode_batch_solves_littles_law() -> None:
    base, slope = step_line(MEASURED.decode_steps)
    assert slope > 0 and base > 0
    load = Load(20.0, Lengths.fixed(500), Lengths.fixed(200))
    itl, b = decode_itl(4, load, MEASURED.decode_steps)
    assert itl == pytest.approx(base + slope * b)
    assert b == pytest.approx(load.rate * 200 * itl / 4)  # streams = arrivals x their length / n
    assert decode_itl(1, Load(1000.0, Lengths.fixed(500), Lengths.fixed(200)),
                      MEASURED.decode_steps) == (float("inf"), float("inf"))
    # two points give the line through them exactly
    assert step_line(((2, 0.012), (10, 0.020))) == pytest.approx((0.010, 0.001))
    # one batch size: flat up to it, no faster beyond it
    flat = ((8, 0.02),)
    assert decode_itl(2, Load(1.0, Lengths.fixed(10), Lengths.fixed(100)), flat)[0] == 0.02
    assert decode_itl(1, Load(10.0, Lengths.fixed(10), Lengths.fixed(100)), flat)[0] == float("inf")
    # a step's time proportional to its batch (a CPU): the line runs through the origin, the
    # fixed point is b = 0, and a stream's step still takes one stream's time, not zero
    proportional = ((1, 0.04), (4, 0.16), (8, 0.32))
    assert step_line(proportional) == pytest.approx((0.0, 0.04))
    itl, b = decode_itl(2, Load(0.1, Lengths.fixed(10), Lengths.fixed(100)), proportional)
    assert (itl, b) == (pytest.approx(0.04), pytest.approx(0.0, abs=1e-9))
    # and a pod keeps up only below 1 / 0.04 = 25 tokens per second
    assert decode_itl(1, Load(0.3, Lengths.fixed(10), Lengths.fixed(100)), proportional)[0] == float("inf")


def test_each_role_follows_the_load_that_is_its_own() -> None:
    base = plan(Load(4.0, Lengths.fixed(800), Lengths.fixed(200)), MEASURED, TARGETS)
    prefill_heavy = plan(Load(4.0, Lengths.fixed(4000), Lengths.fixed(200)), MEASURED, TARGETS)
    decode_heavy = plan(Load(4.0, Lengths.fixed(800), Lengths.fixed(3000)), MEASURED, TARGETS)
    assert all(p.met for p in (*base.values(), *prefill_heavy.values(), *decode_heavy.values()))
    assert prefill_heavy["prefill"].replicas > base["prefill"].replicas
    assert prefill_heavy["decode"].replicas == base["decode"].replicas
    assert decode_heavy["decode"].replicas > base["decode"].replicas
    assert decode_heavy["prefill"].replicas == base["prefill"].replicas
    # the smallest count that meets the target: one fewer misses it
    heavy_p, heavy_d = prefill_heavy["prefill"].replicas, decode_heavy["decode"].replicas
    fewer = Targets(TARGETS.ttft_s, TARGETS.itl_s, (1, heavy_p - 1), (1, heavy_d - 1))
    assert not plan(Load(4.0, Lengths.fixed(4000), Lengths.fixed(200)), MEASURED,
                    fewer)["prefill"].met
    assert not plan(Load(4.0, Lengths.fixed(800), Lengths.fixed(3000)), MEASURED,
                    fewer)["decode"].met


def test_bounds_and_reasons() -> None:
    quiet = plan(Load(0.0, Lengths.fixed(100), Lengths.fixed(10)), MEASURED,
                 Targets(0.5, 0.03, prefill=(2, 8), decode=(3, 8)))
    assert (quiet["prefill"].replicas, quiet["decode"].replicas) == (2, 3)  # the mins
    flood = plan(Load(500.0, Lengths.fixed(1000), Lengths.fixed(100)), MEASURED,
                 Targets(0.5, 0.03, prefill=(1, 8), decode=(1, 8)))
    assert flood["prefill"].replicas == 8 and not flood["prefill"].met
    assert "even 8 pod(s) (the max)" in flood["prefill"].why
    too_long = plan(Load(1.0, Lengths.fixed(4000), Lengths.fixed(10)), MEASURED,
                    Targets(0.5, 0.03, prefill=(1, 8), decode=(1, 8)))["prefill"]
    assert not too_long.met and "a mean prompt alone takes 1.000 s" in too_long.why
    kv_bound = plan(Load(20.0, Lengths.fixed(2000), Lengths.fixed(200)),
                    Measured(4000.0, MEASURED.decode_steps, decode_kv_tokens=20000),
                    Targets(5.0, 1.0, decode=(1, 32)))["decode"]
    loose = plan(Load(20.0, Lengths.fixed(2000), Lengths.fixed(200)), MEASURED,
                 Targets(5.0, 1.0, decode=(1, 32)))["decode"]
    assert kv_bound.met and kv_bound.replicas > loose.replicas  # their KV must fit too
    assert kv_bound.details["streams_per_pod"] * 2200 <= 20000


def test_baton_plan_prints_the_plan_from_figures(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    figures = {"rate": 4.0, "prompt_tokens": [600, 800, 1000], "output_tokens": {"mean": 200},
               "prefill_tokens_per_s": 4000, "decode_steps": [[1, 0.010], [16, 0.016], [64, 0.040]],
               "ttft_target_s": 0.5, "itl_target_s": 0.03,
               "replicas": {"prefill": [1, 16], "decode": [1, 16]}}
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(figures))
    assert main([str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = plan(*figures_from(figures))
    assert {r: printed[r]["replicas"] for r in printed} == {r: p.replicas for r, p in want.items()}
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("prefill")
    path.write_text(json.dumps({**figures, "rate": "lots"}))
    assert main([str(path)]) == 2
    assert "planner figures" in capsys.readouterr().err
