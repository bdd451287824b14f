"""A worker's event streams (framing from runtime/sse.py, shared with the router), and waiting on
work while watching for the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.sse import DONE, HEADERS, ClientGone, event

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5
__all__ = ["DONE", "ClientGone", "event", "sse_response", "until_disconnect"]


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=HEADERS)


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
