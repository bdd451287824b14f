"""Fixtures for the chart tests: the real Helm v4 engine (helm-python-sdk), offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_support import CRD_FILE, SAMPLE_FILE, Render, load_docs

from charts.manifests import CHART_DIR, render_chart


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def render() -> Render:
    """render(values=None, name="baton", namespace="baton-system") -> the rendered objects."""

    def _render(
        values: dict[str, Any] | None = None, name: str = "baton", namespace: str = "baton-system"
    ) -> list[dict[str, Any]]:
        rendered = render_chart(values, name=name, namespace=namespace)
        return [doc for text in rendered.values() for doc in load_docs(text)]

    return _render


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    docs = load_docs(CRD_FILE.read_text())
    assert len(docs) == 1
    return docs[0]


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.fixture(scope="session")
def sample() -> dict[str, Any]:
    docs = load_docs(SAMPLE_FILE.read_text())
    assert len(docs) == 1
    return docs[0]
