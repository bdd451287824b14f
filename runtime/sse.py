"""Server-sent events as both the workers and the router speak them: the framing of one event,
the end of a stream, the response headers, and what a client that left is called."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
DONE_BYTES = DONE.encode()
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
CLIENT_GONE = 499  # nginx's "client closed request": the status counted for a client that left


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
