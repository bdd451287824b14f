"""An attention backend plugin for tests: the torch backend, whose decode forwards raise once
$BATON_TEST_FAIL_AFTER_STEPS of them have run (default 20), as a bug or a failed collective
would. Loaded in the scheduler process by `--plugin`; select it with
`--attention-backend failing-step`."""

from __future__ import annotations

import os

from runtime.attention.registry import register_attention_backend
from runtime.attention.torch_backend import TorchAttention
from runtime.forward_batch import ForwardBatch

BACKEND = "failing-step"


class FailingStepAttention(TorchAttention):
    decodes = 0

    def begin(self, batch: ForwardBatch) -> None:
        super().begin(batch)
        if batch.mode == "decode":
            FailingStepAttention.decodes += 1
            if FailingStepAttention.decodes > int(os.environ.get("BATON_TEST_FAIL_AFTER_STEPS", "20")):
                raise RuntimeError("injected: a decode step failed")


register_attention_backend(BACKEND, f"{__name__}:FailingStepAttention")
