"""An attention backend plugin for tests: the torch backend, slowed down in proportion to the
prompt tokens a forward prefills, like a long prompt on a slow device (5 ms a token: a
2048-token chunk takes ~10 s). Loaded in the scheduler process by `--plugin`; select it with
`--attention-backend slow-prefill`. When a forward of at least MARK_TOKENS prompt tokens
starts, the file named by $BATON_TEST_PREFILL_MARK is created."""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime.attention.registry import register_attention_backend
from runtime.attention.torch_backend import TorchAttention
from runtime.forward_batch import ForwardBatch

BACKEND = "slow-prefill"
SECONDS_PER_TOKEN = 0.005
MARK_TOKENS = 1024


class SlowPrefillAttention(TorchAttention):
    def begin(self, batch: ForwardBatch) -> None:
        super().begin(batch)
        if batch.mode != "extend":
            return
        tokens = sum(batch.extend_lens)
        mark = os.environ.get("BATON_TEST_PREFILL_MARK")
        if mark and tokens >= MARK_TOKENS:
            Path(mark).touch()
        time.sleep(tokens * SECONDS_PER_TOKEN)


register_attention_backend(BACKEND, f"{__name__}:SlowPrefillAttention")
