"""bench/quant_speed.py end to end on the CPU, tiny: fp32 and int4, one and two prompts at once,
a table with ratios to fp32 and the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_every_mode_reports_its_speed_against_fp32(tmp_path: Path, model_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quant_speed.py"), "--modes", "none,int4",
         "--new", "4", "--conc", "1,2", "--repeat", "1", "--out", str(tmp_path),
         "--llama-server", str(tmp_path / "no-llama-server")],  # the peer: skipped, saying why
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "conc1 tok/s" in run.stdout and "x fp32" in run.stdout
    assert "llama-server: skipped: no llama-server at" in run.stdout
    report = json.loads((tmp_path / "quant_speed.json").read_text())
    assert set(report["modes"]) == {"none", "int4"}
    assert all(v > 0 for row in report["modes"].values() for v in row.values())
