"""Server-sent events framing, and waiting on work while watching for the client leaving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.5


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class ClientGone(Exception):
    pass


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
