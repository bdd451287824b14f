"""Following a relayed stream, so that it can go on elsewhere (docs/router.md "Migration").

A `Follower` reads each SSE event of a one-choice stream as D sends it: it counts the token ids
the client got (`/generate` events carry `output_ids`; OpenAI chunks carry `token_ids`, which
the router asks the workers for and takes out again) and the characters of their text, and
notes the finish reason. After a migration the events come from another worker under another
rid: the follower makes them look like the first worker's (the client's `meta_info.id`, the
first chunk's `id` and `created`, no second `role` delta in a chat).

How an event ends the stream early is typed: an error event is a failure (`StreamError`); an
event with `handover` is a draining decode's planned hand-over (`HandedOver`,
runtime/handover.py), not a failure.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.errors import error_body
from runtime.handover import Handover
from runtime.router.request import CHAT, GENERATE, RoutedRequest, choice_count


class StreamError(Exception):
    """D reported an error inside its stream (its scheduler failed mid-way)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("error")))
        self.body = body


class HandedOver(Exception):
    """D ended the stream with a hand-over: moved (its KV waits at an offer) or drained. `event`
    is what the client gets when the stream cannot go on: D's event, without the offer."""

    def __init__(self, handover: Handover, event: bytes) -> None:
        super().__init__(handover.message)
        self.handover, self.event = handover, event


class Follower:
    def __init__(self, req: RoutedRequest) -> None:
        self.endpoint = req.endpoint
        self.rid = req.client_rid or req.rid  # what /generate's client sees as meta_info.id
        self.ids: list[int] = []
        self.chars = 0
        self.finished = False  # a finish reason was relayed: only usage and [DONE] may follow
        self.migrated = False
        self.first: dict[str, Any] | None = None  # the first OpenAI chunk's id and created

    def resume(self) -> dict[str, Any]:
        """The `resume` field of the request that continues this stream."""
        return {"output_ids": list(self.ids), "text_chars": self.chars}

    def event(self, payload: bytes) -> bytes:
        """One `data: {...}` event as the client gets it, counted; raises HandedOver for a
        hand-over event and StreamError for an error event. Anything that is not a JSON object
        passes as it is."""
        try:
            body = json.loads(payload.removeprefix(b"data: "))
        except ValueError:
            return payload
        if not isinstance(body, dict):
            return payload
        if "handover" in body:
            raise self._handed_over(body)
        if "error" in body:
            raise StreamError(body)
        if self.endpoint == GENERATE:
            self._generate(body)
        else:
            self._openai(body)
        return _event(body)

    def _handed_over(self, body: dict[str, Any]) -> HandedOver | StreamError:
        handover = Handover.from_wire(body["handover"])
        if handover is None:
            return StreamError(error_body(f"the decode ended the stream with a hand-over the "
                                          f"router cannot read: {body['handover']!r}"[:500],
                                          "upstream_error", "decode_bad_handover"))
        body["handover"] = handover.without_offer().to_wire()
        self._own(body)
        return HandedOver(handover, _event(body))

    def _own(self, body: dict[str, Any]) -> None:
        """The event under the first worker's names: the client's rid, the first chunk's id
        and created."""
        if self.endpoint == GENERATE:
            meta = body.get("meta_info")
            if isinstance(meta, dict):
                meta["id"] = self.rid
            return
        if self.first is None:
            self.first = {"id": body.get("id"), "created": body.get("created")}
        body.update(self.first)

    def _generate(self, body: dict[str, Any]) -> None:
        self.ids += body.get("output_ids") or []
        self.chars += len(body.get("text") or "")
        self._own(body)
        meta = body.get("meta_info")
        if isinstance(meta, dict):
            self.finished = self.finished or meta.get("finish_reason") is not None

    def _openai(self, body: dict[str, Any]) -> None:
        self._own(body)
        for choice in body.get("choices") or []:
            self.ids += choice.pop("token_ids", None) or []
            if self.endpoint == CHAT:
                delta = choice.get("delta") or {}
                if self.migrated:
                    delta.pop("role", None)
                self.chars += len(delta.get("content") or "")
            else:
                self.chars += len(choice.get("text") or "")
            self.finished = self.finished or choice.get("finish_reason") is not None


def follower_for(req: RoutedRequest, max_migrations: int) -> Follower | None:
    """A follower for a stream that can move: one choice, migrations allowed."""
    body = req.body
    if max_migrations < 1 or body.get("stream") is not True:
        return None
    return Follower(req) if choice_count(req.endpoint, body) == 1 else None


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode()


def with_client_rid(payload: bytes, client_rid: str | None, sent_rid: str) -> bytes:
    """A /generate event or body of a retry (sent as `sent_rid`) with the client's own rid in
    `meta_info.id`; anything else as it is."""
    if client_rid is None or sent_rid == client_rid:
        return payload
    event = payload.startswith(b"data: ")
    try:
        body = json.loads(payload[6:] if event else payload)
        body["meta_info"]["id"] = client_rid
    except (ValueError, KeyError, TypeError):
        return payload
    out = json.dumps(body, ensure_ascii=False).encode()
    return b"data: " + out if event else out
