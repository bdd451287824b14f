"""Smoke test of bench/gpu.py on the CPU (--smoke: a 2-layer shape, tiny workloads): the script
runs end to end and reports both systems, the decode step and its bound. Speed is measured only
on the lent GPU (README, issue #10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.model_store import is_prepared, prepared_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not is_prepared(prepared_dir("smollm2-135m")),
                                reason="builtin model not prepared")


def test_gpu_bench_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    shape = report["shapes"]["smoke"]
    assert set(shape["hf_static"]) == {"prefill-heavy", "decode-heavy"}
    assert all(v > 0 for v in shape["hf_static"].values())
    for wname, modes in shape["hf_static_by_mode"].items():  # the peer is HF's faster mode
        assert set(modes) == {"compiled", "eager"} and shape["hf_static"][wname] == max(modes.values())
    (baton,) = shape["baton"].values()
    assert set(baton["tok_s"]) == set(shape["hf_static"]) and all(v > 0 for v in baton["tok_s"].values())
    assert baton["decode_step_ms"] > 0 and shape["weight_read_bound_ms"] > 0
    assert "baton / the faster" in proc.stdout and "weight-read bound" in proc.stdout


def test_step_anatomy_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """bench/step_anatomy.py --smoke: both overlap modes, the step loop's parts by thread, the
    host ops; the GIL switch interval it was given is the one it reports."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "step_anatomy.py"), "--smoke",
                           "--steps", "4", "--batch", "3", "--switch-interval-ms", "1",
                           "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "step_anatomy.txt").read_text()
    assert "GIL switch interval 1 ms" in text
    assert "batch 3, overlap on:" in text and "batch 3, overlap off:" in text
    assert "Scheduler.schedule" in text and "ModelRunner.forward_batch" in text
    assert "host ops by self time" in text
