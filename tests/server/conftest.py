"""Server fixtures: few real `baton serve` processes, shared across the server tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.server_process import ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default server (torch sampler), used by the OpenAI, concurrency, error and fuzz tests."""
    srv = start_server("--served-model-name", "smollm2",
                       log_path=tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    from runtime.engine.engine import load_tokenizer

    return load_tokenizer(model_path)
