"""The model's tokenizer in the router (`--tokenizer`), for the cache-aware policy, without
torch (runtime/tokenizer.py). Either a model the router can read (a folder, builtin:NAME),
loaded on first need: a model that is not there yet (a builtin the workers are still
preparing) is looked for again a little later. Or `workers` (FROM_WORKERS): the tokenizer files
of the first ready worker that gives them (GET /tokenizer), for a model only the workers have
(an hf://, pvc:// or file:// model in a cluster). Until it has one, text prompts go by
least_load."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from runtime.router.workers import Workers

log = logging.getLogger("baton.router")

RETRY_S = 10.0
FROM_WORKERS = "workers"
ASK_WORKERS_S = 1.0  # how often the tokenizer is asked of the workers until one gives it


class RouterTokenizer:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._tokenizer: Any = None
        self._next_try = 0.0

    @property
    def from_workers(self) -> bool:
        return self.model == FROM_WORKERS

    def get(self) -> Any | None:
        if self._tokenizer is not None or self.model is None or self.from_workers:
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

    async def learn(self, client: httpx.AsyncClient, workers: Workers) -> None:
        """FROM_WORKERS: ask the ready workers for the tokenizer until one gives it."""
        while self._tokenizer is None:
            for worker in [*workers.prefill.ready(), *workers.decode.ready()]:
                if await self._learn_from(client, worker.url):
                    return
            await asyncio.sleep(ASK_WORKERS_S)

    async def _learn_from(self, client: httpx.AsyncClient, url: str) -> bool:
        from runtime.tokenizer import tokenizer_from_files

        try:
            r = await client.get(f"{url}/tokenizer")
            files = r.json().get("files") if r.status_code == 200 else None
            if not isinstance(files, dict) or "tokenizer.json" not in files:
                return False
            self._tokenizer = await asyncio.to_thread(tokenizer_from_files, files)
        except Exception as e:  # an older worker, a body we cannot read, a folder we cannot load
            log.warning("no tokenizer from %s (%s); asking again", url, e)
            return False
        log.info("tokenizer from worker %s loaded: cache_aware reads text prompts and chats", url)
        return True
