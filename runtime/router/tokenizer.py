"""The model's tokenizer in the router (`--tokenizer`), for the cache-aware policy: loaded on
first need, without torch (runtime/tokenizer.py). A model that is not there yet (a builtin the
workers are still preparing) is looked for again a little later; meanwhile text prompts go by
least_load."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("baton.router")

RETRY_S = 10.0


class RouterTokenizer:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._tokenizer: Any = None
        self._next_try = 0.0

    def get(self) -> Any | None:
        if self._tokenizer is not None or self.model is None:
            return self._tokenizer
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            from runtime.model_store import resolve_model_path
            from runtime.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(resolve_model_path(self.model, prepare_builtin=False))
            log.info("tokenizer of %s loaded: cache_aware reads text prompts and chats", self.model)
        except Exception as e:  # not prepared yet, or not a model folder
            self._next_try = now + RETRY_S
            log.warning("tokenizer %s not loaded (%s); text prompts go by least_load until it "
                        "is, again in %.0f s", self.model, e, RETRY_S)
        return self._tokenizer
