"""`baton serve --device cuda` answers the official openai SDK, streaming and not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.conftest import GPU
from tests.server.server_process import start_server

pytestmark = GPU


def test_openai_sdk_against_a_gpu_server(gpu_model: Path, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    server = start_server("--device", "cuda", "--served-model-name", "gpu", model=str(gpu_model),
                          log_path=tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120,
                           max_retries=0) as client:
            whole = client.completions.create(model="gpu", prompt="The capital of France is",
                                              max_tokens=16, temperature=0)
            parts = client.completions.create(model="gpu", prompt="The capital of France is",
                                              max_tokens=16, temperature=0, stream=True)
            streamed = "".join(c.choices[0].text for c in parts)
            chat = client.chat.completions.create(
                model="gpu", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert whole.usage.completion_tokens == 16 and streamed == whole.choices[0].text
        assert chat.choices[0].message.content is not None
        assert "on cuda" in server.log()  # the model runner says where it runs
    finally:
        assert server.stop() == 0, server.log()
