"""Resuming a stream on this worker (docs/router.md "Migration").

When a stream's decode worker dies or drains, the router sends the same request to another
pair with `resume`: the output tokens its client already has (and how many characters of their
text). The scheduler sees a longer prompt (the prompt and those tokens) and a budget that much
smaller; the client sees the one request going on: prompt and completion token counts as
before, completion tokens counting the resumed ones, and text that starts exactly where the
client's stopped (the detokenizer is primed with the resumed tokens, its cursor at the
characters already sent). Penalties count the resumed tokens as outputs. Greedy continuations,
penalized or not, equal an undisturbed run's; a seeded one samples from the same per-position
draws.
"""

from __future__ import annotations

import dataclasses

from runtime.messages import GenerateRequest
from runtime.protocol import Resume
from runtime.validation import InvalidRequest


def resumed(req: GenerateRequest, resume: Resume | None) -> GenerateRequest:
    """`req` continued after `resume.output_ids` (as it is without a resume)."""
    if resume is None or not resume.output_ids:
        return req
    done = len(resume.output_ids)
    params = dict(req.sampling_params)
    left = int(params["max_new_tokens"]) - done
    if left < 1:
        raise InvalidRequest(f"resume: the request's {params['max_new_tokens']} tokens are all "
                             "generated already", "resume")
    params["max_new_tokens"] = left
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - done)
    return dataclasses.replace(req, input_ids=[*req.input_ids, *resume.output_ids],
                               sampling_params=params, resumed_outputs=done)


def check_one_choice(resume: Resume | None, choices: int) -> None:
    if resume is not None and choices != 1:
        raise InvalidRequest("resume: only a request with one choice can be resumed", "resume")
