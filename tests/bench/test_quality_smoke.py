"""Smoke test of bench/quality.py on the tiny model: it runs end to end, scores at least 2,000
teacher-forced positions of its text, and a mode identical to the reference agrees everywhere
(float32 against float32: 100 %, no logprob difference), while bf16 and fp8 (weights and
activations, emulated in float32) differ somewhat, fp8 held to its 97 % target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "quality.py"


def test_the_gate_scores_every_position(tiny_path: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_path), "--modes", "float32,bfloat16,fp8",
         "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modes = json.loads((tmp_path / "quality.json").read_text())["modes"]
    same, bf16 = modes["float32"], modes["bfloat16"]
    assert same["positions"] >= 2000 and same["agreement_pct"] == 100.0
    assert same["mean_abs_dlogprob"] == 0.0 and same["passes"] is None
    for mode in (bf16, modes["fp8"]):
        assert mode["positions"] == same["positions"] and 0 < mode["mean_abs_dlogprob"] < 1
    assert modes["fp8"]["target_pct"] == 97.0
