"""Smoke test of bench/tp.py --smoke: the tiny model at tp 1 and 2, in the Engine and under
`baton serve`, end to end on the CPU. It prints its tables, writes tp.json with every case, the
collectives' share of rank 0's forward, greedy tokens equal to tp=1's, and no server process
left behind. Speed is never asserted (on 2 cores tp=2 is not faster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.model_store import is_prepared, prepared_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not is_prepared(prepared_dir("smollm2-135m")),
                       reason="builtin model not prepared (its tokenizer is the tiny model's)"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    # the ranks and servers share this machine's cores with the rest of the suite
    env = dict(os.environ, PYTHONPATH=str(REPO), GOMP_SPINCOUNT="0")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tp.py"), "--smoke",
                           "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "tp.json").read_text())


def test_every_case_reports_throughput_and_ttft(run: tuple[str, dict[str, Any]]) -> None:
    _, report = run
    for part, ttft in (("engine", "ttft_batch_ms"), ("serve", "ttft_p50_ms")):
        rows = report[part]
        assert [(r["model"], r["tp"]) for r in rows] == [("tiny", 1), ("tiny", 2)], part
        for r in rows:
            assert r["error"] is None, (part, r)
            assert r["out_tok_s"] > 0 and r[ttft] > 0, (part, r)
        assert rows[1]["vs_tp1"]["out_tok_s"] == pytest.approx(
            rows[1]["out_tok_s"] / rows[0]["out_tok_s"])
    assert all(r["left_behind"] == [] for r in report["serve"])


def test_greedy_tokens_equal_tp1s(run: tuple[str, dict[str, Any]]) -> None:
    """The tiny model's weights are large, so greedy has margins: no near-tie to excuse."""
    _, report = run
    n = report["workload"]["num_prompts"]
    for part in ("engine", "serve"):
        tokens = report[part][1]["tokens_vs_tp1"]
        assert tokens["equal"] == n, (part, tokens)
    assert report["engine"][1]["tokens_vs_tp1"]["max_logprob_delta"] < 1e-3
    assert all(r["timed_run_equals_check_run"] for r in report["engine"])


def test_the_collectives_share_of_rank_0s_step(run: tuple[str, dict[str, Any]]) -> None:
    """tp=2: the embedding's all-reduce and 2 per layer (2 layers), one logits all-gather and
    one send to the follower per forward, and a share of the forward between 0 and 1."""
    _, report = run
    for mode, s in report["engine"][1]["steps"].items():
        assert s["all_reduce_calls"] == 5 and s["all_gather_calls"] == 1, (mode, s)
        assert s["send_calls"] == 1, (mode, s)
        assert 0 < s["collective_share"] < 1, (mode, s)
    assert set(report["engine"][1]["steps"]) == {"extend", "decode"}


def test_the_tables_are_printed(run: tuple[str, dict[str, Any]]) -> None:
    stdout, _ = run
    assert "Engine (x tp1" in stdout and "Rank 0's step" in stdout and "`baton serve --tp N`" in stdout
    assert "3/3 equal" in stdout
