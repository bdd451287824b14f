"""JsonRoute: the FastAPI route class of every endpoint that takes a body.

The body is read and checked by `runtime.validation.parse_json_body` before FastAPI sees it
(JSON by Content-Type, an object, finite numbers, no lone surrogates anywhere), so those
problems are a 4xx naming the field on every endpoint, exactly as `baton router` answers them.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from runtime.validation import parse_json_body


class JsonRequest(Request):
    """A request whose `json()` is the checked body."""

    parsed: dict[str, Any] | None = None

    async def json(self) -> Any:
        if self.parsed is None:
            self.parsed = parse_json_body(await self.body(), self.headers.get("content-type"))
        return self.parsed


class JsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked(request: Request) -> Response:
            request = JsonRequest(request.scope, request.receive)
            await request.json()  # raises InvalidRequest before any model validation
            return await handler(request)

        return checked
