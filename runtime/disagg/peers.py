"""The decode server's side of its conversations with prefill bootstrap servers.

Blocking HTTP calls, made from the decode role's worker threads, never from the scheduler loop.
A prefill is known by its address; what is cached about it (that we registered with it, under
which instance id) is dropped whenever it answers "unknown peer" or stops answering, so a prefill
that restarted on the same address is found again.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict
from typing import Any

import httpx

from runtime.auth.key import ClusterKey
from runtime.auth.signed import sign_call
from runtime.disagg.rooms import RoomInUse
from runtime.disagg.shares import Split, plan
from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.disagg.wire import KVLayout, PeerRegistration, RoomRequest
from runtime.errors import error_message

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 5.0
Address = tuple[str, int]


class Ambiguous(TransferError):
    """The request may or may not have reached the prefill: treat the room as registered."""


class PrefillClient:
    def __init__(self, me: PeerRegistration, transfer: KVTransfer, key: ClusterKey,
                 heartbeat_s: float) -> None:
        self.me = me
        self.transfer = transfer
        self.key = key  # signs every state-changing call (runtime/auth/signed.py)
        self.http = httpx.Client(timeout=HTTP_TIMEOUT_S)
        self.heartbeat_s = min(heartbeat_s, HTTP_TIMEOUT_S)  # an answer later than this: a miss
        self.registered: dict[Address, tuple[str, int]] = {}  # prefill address -> its instance
        # id and TP size
        self._lock = threading.Lock()

    def register_room(self, addr: Address, request: RoomRequest) -> str:
        """Tell the prefill at `addr` where to write `request.room`'s KV; its instance id. First
        the room is bound to that instance (`WriteFence.bind_peer`: only its links may write
        the pages). Raises RoomInUse, TransferError (it refused or cannot be reached, or the
        room ended meanwhile: nothing will be written) or Ambiguous."""
        for attempt in range(2):
            instance, tp = self._ensure_registered(addr)
            shares = None  # one rank each side: the whole page from the one prefill rank
            if tp > 1 or self.transfer.split.tp > 1:
                shares = plan(Split(tp, self.transfer.split.kv_heads), self.transfer.split)
            if not self.transfer.fence.bind_peer(request.room, instance, shares):
                named = self.transfer.fence.peer_of(request.room)
                if named is not None and named != instance and attempt == 0:
                    self.forget(addr)  # the ticket names a newer instance: look again
                    continue
                raise TransferError(f"room {request.room} is not for prefill {instance} at "
                                    f"{_url(addr)} (it ended, or its ticket names {named})")
            resp = self._call("POST", addr, "/rooms", asdict(request))
            if resp.status_code == 200:
                return instance
            if resp.status_code == 404 and _code(resp) == "unknown_peer":
                self.forget(addr)  # it restarted: introduce ourselves again
                self.transfer.fence.unbind_peer(request.room)  # to the new instance
                continue
            if resp.status_code == 409 and _code(resp) == "room_in_use":
                raise RoomInUse(error_message(resp))
            raise TransferError(
                f"prefill {_url(addr)} refused room {request.room}: {error_message(resp)}"
            )
        raise TransferError(f"prefill {_url(addr)} keeps forgetting this decode server")

    def cancel_room(self, addr: Address, room: int) -> bool:
        """True when the prefill promises not to write `room` (or cannot: it is gone)."""
        path = f"/rooms/{room}"
        try:
            resp = self.http.delete(f"{_url(addr)}{path}", headers=sign_call(self.key, "DELETE", path, b""))
        except httpx.HTTPError as e:
            if refused(e):
                return True  # nothing listens there: the prefill closes its port last, so it is gone
            log.info("cancel of room %d at %s: %s", room, _url(addr), e)
            return False
        return resp.status_code == 200

    def alive(self, addr: Address) -> bool:
        try:
            return self.http.get(f"{_url(addr)}/health", timeout=self.heartbeat_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _ensure_registered(self, addr: Address) -> tuple[str, int]:
        """The instance id and TP size of the prefill at `addr`, introducing ourselves first if
        needed."""
        with self._lock:
            if addr in self.registered:
                return self.registered[addr]
        route = self._call("GET", addr, "/route", None)
        if route.status_code != 200:
            raise TransferError(f"prefill {_url(addr)} is not ready: {error_message(route)}")
        info = route.json()
        theirs = KVLayout(**info["layout"])
        problem = theirs.mismatch(self.transfer.layout)
        if problem:
            raise TransferError(f"prefill {_url(addr)} cannot send KV here: KV layouts differ "
                                f"(that prefill vs this decode): {problem}")
        if info.get("backend") != self.transfer.name:
            raise TransferError(f"prefill {_url(addr)} sends KV with {info.get('backend')!r}, "
                                f"this decode server expects {self.transfer.name!r} (--kv-transfer)")
        resp = self._call("POST", addr, "/peers", asdict(self.me))
        if resp.status_code != 200:
            raise TransferError(
                f"prefill {_url(addr)} refused this decode server: {error_message(resp)}"
            )
        instance, tp = str(info.get("instance_id")), info.get("tp", 1)
        if type(tp) is not int or not 1 <= tp <= 4096:
            raise TransferError(f"prefill {_url(addr)} says its TP size is {tp!r}")
        with self._lock:
            self.registered[addr] = instance, tp
        return instance, tp

    def forget(self, addr: Address) -> None:
        with self._lock:
            self.registered.pop(addr, None)

    def _call(self, method: str, addr: Address, path: str, body: dict[str, Any] | None) -> httpx.Response:
        raw = json.dumps(body).encode() if body is not None else b""
        headers = {"Content-Type": "application/json", **sign_call(self.key, method, path, raw)}
        try:
            return self.http.request(method, f"{_url(addr)}{path}", content=raw, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.forget(addr)
            raise TransferError(f"prefill {_url(addr)} is unreachable: {e}") from e
        except httpx.HTTPError as e:
            self.forget(addr)
            raise Ambiguous(f"prefill {_url(addr)} did not answer {method} {path}: {e}") from e

    def close(self) -> None:
        self.http.close()


def refused(error: BaseException | None) -> bool:
    """The connection was refused: nothing listens on that port (unlike a timeout, or no route
    to the host, which a frozen or cut-off process that may still write also gives)."""
    while error is not None:
        if isinstance(error, ConnectionRefusedError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _url(addr: Address) -> str:
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    return f"http://{host}:{addr[1]}"


def _code(resp: httpx.Response) -> str | None:
    try:
        return str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None
