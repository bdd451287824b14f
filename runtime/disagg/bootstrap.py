"""The prefill server's bootstrap HTTP server (`--bootstrap-port`), where decode servers find it.

GET  /health                 200 while the process is up
GET  /route                  503 until the KV endpoint is registered; then instance id, layout
                             and transfer backend (a restarted prefill has a new instance id);
                             signed, like every call but /health (runtime/auth/signed.py)
POST /peers                  a decode server introduces itself (PeerRegistration); 409 when its
                             KV layout or backend cannot work with ours, saying what differs
POST /rooms                  a decode server's pages for one room (RoomRequest); 404 unknown_peer
                             (re-register), 409 room_in_use
DELETE /rooms/<room>         cancel: 200 {"cancelled": true} promises no write will happen;
                             202 {"cancelled": false} means a transfer is under way, and its
                             aux record (behind the pages) or RoomFailed frame will follow
A small stdlib ThreadingHTTPServer on its own threads; what it learns goes to a `Rooms` owner
(the prefill role) which is thread-safe. Bodies are bounded (413) and built into strict types
(runtime/disagg/wire.py): a wrong type or value is a 400 that names the field.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from runtime.auth.signed import HEADER, CallGate
from runtime.auth.ticket import TicketRefused
from runtime.disagg.rooms import RoomInUse
from runtime.disagg.tally import Tally
from runtime.disagg.wire import PeerRegistration, RoomRequest
from runtime.errors import error_body

log = logging.getLogger(__name__)


class PeerRejected(ValueError):
    """A decode server whose pool cannot receive our pages (the message says why): a 409."""


class UnknownPeer(KeyError):
    pass


class BodyTooLarge(ValueError):
    pass


MAX_BODY = 1 << 20  # a PeerRegistration or RoomRequest is a few KB

class Rooms(Protocol):
    def route(self) -> dict[str, Any] | None: ...
    def register_peer(self, peer: PeerRegistration) -> dict[str, Any]: ...
    def offer_room(self, request: RoomRequest) -> None: ...
    def cancel_room(self, room: int) -> bool: ...


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("bootstrap: " + fmt, *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str) -> None:
        self._reply(status, error_body(message, "bootstrap_error", code))

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if not 0 <= n <= MAX_BODY:
            raise BodyTooLarge(f"a body of {n} bytes (at most {MAX_BODY})")
        return self.rfile.read(n)

    def _authorized(self, body: bytes) -> bool:
        """A signed call of a decode of this deployment (runtime/auth/signed.py)? Else 401/403."""
        problem = self.server.gate.problem(self.headers.get(HEADER), self.command, self.path, body)
        if problem is None:
            return True
        status, why = problem
        self.server.tally.add("bad_call")
        log.warning("bootstrap: %s %s from %s refused: %s", self.command, self.path,
                    self.client_address[0], why)
        self._error(status, why, "unauthorized" if status == 401 else "forbidden")
        return False

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/route":  # the layout and instance: for this deployment's decodes
            if not self._authorized(b""):
                return
            route = self.server.rooms.route()
            if route is None:
                self._error(503, "the KV endpoint is not registered yet", "not_ready")
            else:
                self._reply(200, route)
        else:
            self._error(404, f"no route {self.path}", "not_found")

    def do_POST(self) -> None:
        try:
            raw = self._body()
            if self.path not in ("/peers", "/rooms"):
                self._error(404, f"no route {self.path}", "not_found")
                return
            if not self._authorized(raw):
                return
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            if self.path == "/peers":
                info = self.server.rooms.register_peer(PeerRegistration(**body))
                self._reply(200, {"backend_info": info})
            else:
                self.server.rooms.offer_room(RoomRequest(**body))
                self._reply(200, {"room": body["room"], "accepted": True})
        except UnknownPeer as e:
            self._error(404, f"unknown decode server {e}; register with POST /peers", "unknown_peer")
        except RoomInUse as e:
            self._error(409, str(e), "room_in_use")
        except PeerRejected as e:
            self._error(409, str(e), "peer_rejected")
        except TicketRefused as e:
            self.server.tally.add("bad_call")
            self._error(e.status, str(e), e.code)
        except BodyTooLarge as e:
            self.close_connection = True  # its body is still unread
            self._error(413, str(e), "body_too_large")
        except (ValueError, TypeError, KeyError) as e:
            self._error(400, f"bad request: {e}", "bad_request")
        except Exception:  # a bug: answered, not a connection dropped mid-call
            log.exception("bootstrap %s %s failed", self.command, self.path)
            self._error(500, "internal error (logged)", "internal_error")

    def do_DELETE(self) -> None:
        prefix = "/rooms/"
        room = self.path[len(prefix):]
        if not self.path.startswith(prefix) or not room.isdigit() or len(room) > 19:
            self._error(404, f"no route {self.path}", "not_found")
            return
        if self._authorized(b""):
            cancelled = self.server.rooms.cancel_room(int(room))
            self._reply(200 if cancelled else 202, {"cancelled": cancelled})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    rooms: Rooms
    gate: CallGate
    tally: Tally


class BootstrapServer:
    def __init__(self, host: str, port: int, rooms: Rooms, gate: CallGate, tally: Tally) -> None:
        try:
            self.httpd = _Server((host, port), _Handler)
        except OSError as e:
            raise OSError(f"bootstrap server cannot listen on {host}:{port}: {e} "
                          "(--bootstrap-port)") from e
        self.httpd.rooms, self.httpd.gate, self.httpd.tally = rooms, gate, tally
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="bootstrap", daemon=True)
        self.thread.start()
        log.info("bootstrap server on %s:%d", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
