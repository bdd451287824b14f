"""Engine: the offline API. `Engine(model=..., **engine_args).generate(prompts, sampling_params)`.

Runs the scheduler and model in this process. The serving layer runs the same Scheduler in its
own process and feeds it over ZMQ; both produce the same tokens. It sits above the scheduler it
drives (docs/architecture.md: scheduler -> engine), so it is not in engine/, which holds the ModelRunner.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from runtime.config import CanaryConfig, EngineConfig, SchedulerConfig
from runtime.messages import ReqOutput
from runtime.result import cut_at_stop, generate_result
from runtime.sampling_params import InvalidRequest, SamplingParams
from runtime.scheduler.ranks import start_model
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from runtime.tokenizer import load_tokenizer, tail_decoder


def split_engine_args(kwargs: dict[str, Any]) -> tuple[EngineConfig, SchedulerConfig, CanaryConfig]:
    """Route keyword arguments to the config that owns them; unknown names are an error."""
    classes = (EngineConfig, SchedulerConfig, CanaryConfig)
    fields = [{f.name for f in dataclasses.fields(cls)} for cls in classes]
    unknown = sorted(set(kwargs).difference(*fields))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(set().union(*fields))}")
    engine, sched, canary = (cls(**{k: v for k, v in kwargs.items() if k in names})  # type: ignore[operator]
                             for cls, names in zip(classes, fields, strict=True))
    return engine, sched, canary


class Engine:
    """Not thread-safe: one generate() at a time."""

    def __init__(self, model: str = "builtin:smollm2-135m", **engine_args: Any) -> None:
        engine_cfg, sched_cfg, canary = split_engine_args({"model": model, **engine_args})
        # under tp > 1 the other ranks start with it (runtime/scheduler/ranks.py)
        self.runner, self.ranks = start_model(engine_cfg, sched_cfg.max_running_requests,
                                              canary=canary)
        self.tokenizer = load_tokenizer(self.runner.model_path)
        self.scheduler = Scheduler(sched_cfg, self.runner, decode_tail=tail_decoder(self.tokenizer),
                                   canary=canary, ranks=self.ranks)

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> Any:
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Any] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        reqs = self._make_reqs(batch, sampling_params, return_logprob, top_logprobs_num)
        for req in reqs:  # validate every request before any runs
            self.scheduler.validate(req)
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            self._run_until_done({r.rid for r in reqs})
        finally:
            for req in reqs:  # an interrupted call leaves nothing behind
                if not req.finished:
                    self.scheduler.abort(req.rid, "generate() interrupted")
            while self.scheduler.has_work():
                self.scheduler.step()
        results = [self._result(r) for r in reqs]
        return results[0] if single else results

    def _make_reqs(
        self,
        prompts: list[Any],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        return_logprob: bool,
        top_logprobs_num: int,
    ) -> list[Req]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise InvalidRequest(
                    f"{len(sampling_params)} sampling_params for {len(prompts)} prompts",
                    "sampling_params",
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(prompts)
        if top_logprobs_num < 0:
            raise InvalidRequest("top_logprobs_num must be >= 0", "top_logprobs_num")
        reqs = []
        for prompt, sp in zip(prompts, params, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            reqs.append(
                Req(
                    rid=uuid.uuid4().hex,
                    origin_input_ids=ids,
                    sampling_params=sp,
                    return_logprob=return_logprob or top_logprobs_num > 0,
                    top_logprobs_num=top_logprobs_num,
                )
            )
        return reqs

    def _run_until_done(self, rids: set[str]) -> list[ReqOutput]:
        outputs = []
        while rids:
            for out in self.scheduler.step():
                outputs.append(out)
                if out.finished:
                    rids.discard(out.rid)
            if not self.scheduler.has_work() and rids:
                raise RuntimeError(f"scheduler idle with {len(rids)} unfinished requests")
        return outputs

    def _result(self, req: Req) -> dict[str, Any]:
        sp = req.sampling_params
        text = str(self.tokenizer.decode(req.output_ids, skip_special_tokens=sp.skip_special_tokens))
        return generate_result(
            req.rid, cut_at_stop(text, req.finished_reason), req.output_ids,
            len(req.origin_input_ids), len(req.output_ids), req.finished_reason,
            req.log.logprobs if req.return_logprob else None,
            req.log.top_logprobs if req.return_logprob and req.top_logprobs_num else None,
            req.log.info, req.cached_tokens)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
