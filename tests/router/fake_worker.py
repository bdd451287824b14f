"""Worker stand-ins: small real FastAPI apps on loopback that answer like baton workers do
(the JSON of /generate and the OpenAI endpoints, SSE ending in `data: [DONE]`, /ready, /abort)
and record what they received.

A test steers one request's behaviour on one side through the body it sends, which the
router passes on: `{"fake": {"prefill": {...}, "decode": {...}}}` with
- `status`, `message`: answer with that HTTP status and a worker-shaped JSON error;
- `hang`: answer nothing until the request is aborted through /abort (then finish "abort");
- `chunks`: stream this many content events (default 3);
- `gated`: before each event after the first, wait until the test calls `release()`;
- `every_s`: wait this long before each event after the first (a steady stream);
- `die_after`: drop the connection after this many events (no [DONE]);
- `error_after`: after this many events, an in-band error event, then [DONE];
- `move_after` with `move` (bootstrap host, port, room): after this many events, the hand-over
  event of a draining decode that moved the stream's KV ("moved", its offer naming its instance
  id), then [DONE];
- `drain_after`: after this many events, the hand-over event of a draining decode whose grace
  period ended ("drained"), then [DONE];
- `delay_s`: wait this long before answering;
- `linger_s`: keep the stream open this long after `data: [DONE]`.
A stream with `resume` starts at event len(resume.output_ids) (event i is token i, "toki ").
A worker's own `steer` (set by the test) is applied over the body's, to make one worker of a
role fail (with `only_port`, only its requests whose `bootstrap_port` is that one); a decode
worker fails with 502 `kv_transfer_failed` every request whose prefill has a bootstrap port in
`broken_links` (a P<->D link that does not work).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.router.server_thread import ServerThread

HANG_LIMIT_S = 30.0
TRANSFER_FAILED = "kv_transfer_failed"


@dataclass
class Received:
    path: str
    body: dict[str, Any]


class FakeWorker:
    def __init__(self, role: str, host: str = "127.0.0.1", port: int | None = None,
                 bootstrap_port: int = 8998) -> None:
        self.role, self.bootstrap_port = role, bootstrap_port
        self.ready = True
        self.ready_delay_s = 0.0  # GET /ready answers this late
        self.kv_transfer: dict[str, Any] | None = None  # what its /ready shows, if anything
        self.revision: str | None = None  # its /ready's revision, if any
        self.local_prefill = False  # a decode's /ready: it prefills requests without a room
        self.instance_id = f"fake-{role}-{id(self):x}"  # its /ready: room tickets name it
        self.received: list[Received] = []
        self.aborts: list[str] = []
        self.sent_at: list[float] = []  # time.monotonic() of every streamed event
        self.steer: dict[str, Any] = {}  # over every request's own steering
        self.broken_links: set[int] = set()  # decode: bootstrap ports of prefills it can't reach
        self._gate = threading.Semaphore(0)
        self.server = ServerThread(self._app(), host, port)
        self.url = self.server.url

    @property
    def arg(self) -> str:
        """How `baton router` names this worker (`--prefill URL,PORT` / `--decode URL`)."""
        return f"{self.url},{self.bootstrap_port}" if self.role == "prefill" else self.url

    def start(self) -> FakeWorker:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def release(self, n: int = 1) -> None:
        """Let a `gated` stream send its next `n` events."""
        for _ in range(n):
            self._gate.release()

    def generation(self, rid: str | None = None, wait_s: float = 2.0) -> Received:
        """The last generation request received (with that rid). Waits a little for it: the
        router answers with D's response, which a stand-in D may send before P got its copy."""
        deadline = time.monotonic() + wait_s
        while True:
            for r in reversed(self.received):
                if rid is None or r.body.get("rid") == rid:
                    return r
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role} {self.url} received no request {rid or ''}")
            time.sleep(0.01)

    def got(self, rid: str) -> bool:
        return any(r.body.get("rid") == rid for r in self.received)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready() -> Response:
            await asyncio.sleep(self.ready_delay_s)
            body: dict[str, Any] = {"ready": self.ready, "instance_id": self.instance_id}
            if self.kv_transfer is not None:
                body["kv_transfer"] = self.kv_transfer
            if self.revision is not None:
                body["revision"] = self.revision
            if self.local_prefill:
                body["local_prefill"] = True
            return JSONResponse(body, 200 if self.ready else 503)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": f"fake-{self.role}", "object": "model"}]}

        @app.post("/abort")
        async def abort(request: Request) -> dict[str, Any]:
            rid = (await request.json())["rid"]
            self.aborts.append(rid)
            return {"rid": rid, "aborted": True}

        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._generation(path), methods=["POST"])
        return app

    def _generation(self, path: str) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response:
            body = await request.json()
            self.received.append(Received(path, body))
            own = self.steer  # (one with `only_port` steers only requests from that port)
            if "only_port" in own and body.get("bootstrap_port") != own["only_port"]:
                own = {}
            steer = {**body.get("fake", {}).get(self.role, {}), **own}
            if body.get("bootstrap_port") in self.broken_links:
                steer = {"status": 502, "message": "KV transfer failed", "code": TRANSFER_FAILED}
            await asyncio.sleep(steer.get("delay_s", 0))
            if "status" in steer:
                error = {"message": steer.get("message", "fake failure"),
                         "type": "invalid_request_error", "code": steer.get("code", "fake"),
                         "param": None}
                return JSONResponse({"error": error}, steer["status"])
            finish = "length"
            if steer.get("hang"):
                finish = await self._until_aborted(body["rid"])
            if body.get("stream"):
                return StreamingResponse(self._events(path, body, steer, finish),
                                         media_type="text/event-stream")
            return JSONResponse(_result(path, body, steer.get("chunks", 3), finish))

        return route

    async def _until_aborted(self, rid: str) -> str:
        deadline = time.monotonic() + HANG_LIMIT_S
        while rid not in self.aborts:
            if time.monotonic() > deadline:
                return "hang_limit"
            await asyncio.sleep(0.01)
        return "abort"

    async def _events(self, path: str, body: dict[str, Any], steer: dict[str, Any],
                      finish: str) -> AsyncIterator[str]:
        chunks = steer.get("chunks", 3)
        start = len((body.get("resume") or {}).get("output_ids", []))  # a resumed stream
        for i in range(start, chunks):
            if i > start and steer.get("gated"):
                await self._wait_gate()
            if i > start and steer.get("every_s"):
                await asyncio.sleep(steer["every_s"])
            if steer.get("die_after") == i:
                raise ConnectionResetError("fake worker dies mid-stream")
            if steer.get("error_after") == i:  # as a worker whose scheduler failed mid-stream
                yield _sse({"error": {"message": "scheduler died", "type": "server_error",
                                      "code": "stream_failed", "param": None}})
                break
            if steer.get("move_after") == i:  # as a draining decode that moved the KV away
                offer = {"instance_id": self.instance_id, **steer["move"]}
                yield _sse(_handover(path, body, {"kind": "moved", "kv_offer": offer}))
                break
            if steer.get("drain_after") == i:  # as a decode whose grace period ended
                yield _sse(_handover(path, body, {"kind": "drained", "kv_offer": None}))
                break
            last = i == chunks - 1
            self.sent_at.append(time.monotonic())
            yield _sse(_chunk(path, body, i, finish if last else None))
        yield "data: [DONE]\n\n"
        await asyncio.sleep(steer.get("linger_s", 0))

    async def _wait_gate(self) -> None:
        deadline = time.monotonic() + HANG_LIMIT_S
        while not self._gate.acquire(blocking=False):
            if time.monotonic() > deadline:
                raise TimeoutError("gate never released")
            await asyncio.sleep(0.005)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _handover(path: str, body: dict[str, Any], handover: dict[str, Any]) -> dict[str, Any]:
    """A hand-over event (runtime/handover.py): no tokens, and `handover`."""
    handover = {**handover, "message": f"the server is draining ({handover['kind']})"}
    if path == "/generate":
        meta = {"id": body["rid"], "completion_tokens": 0,
                "finish_reason": {"type": handover["kind"]}}
        return {"text": "", "output_ids": [], "meta_info": meta, "handover": handover}
    kind = "text_completion" if path == "/v1/completions" else "chat.completion.chunk"
    return {"id": f"cmpl-{body['rid']}", "object": kind, "created": int(time.time()),
            "model": body.get("model", "fake"), "choices": [], "handover": handover}


def _result(path: str, body: dict[str, Any], n: int, finish: str) -> dict[str, Any]:
    text = "".join(f"tok{i} " for i in range(n))
    if path == "/generate":
        meta = {"id": body["rid"], "prompt_tokens": 4, "completion_tokens": n,
                "finish_reason": {"type": finish}}
        return {"text": text, "output_ids": list(range(n)), "meta_info": meta}
    if path == "/v1/completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": finish}
        kind = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish}
        kind = "chat.completion"
    usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
    return {"id": f"cmpl-{body['rid']}", "object": kind, "created": 0,
            "model": body.get("model", "fake"), "choices": [choice], "usage": usage}


def _chunk(path: str, body: dict[str, Any], i: int, finish: str | None) -> dict[str, Any]:
    if path == "/generate":
        meta = {"id": body["rid"], "completion_tokens": 1,
                "finish_reason": None if finish is None else {"type": finish}}
        return {"text": f"tok{i} ", "output_ids": [i], "meta_info": meta}
    if path == "/v1/completions":
        choice: dict[str, Any] = {"index": 0, "text": f"tok{i} ", "finish_reason": finish}
        kind = "text_completion"
    else:
        delta = {"content": f"tok{i} "} | ({"role": "assistant"} if i == 0 or (body.get("resume")
                                            and i == len(body["resume"]["output_ids"])) else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    if body.get("return_token_ids"):
        choice["token_ids"] = [i]
    return {"id": f"cmpl-{body['rid']}", "object": kind, "created": int(time.time()),
            "model": body.get("model", "fake"), "choices": [choice]}
