"""A fault plugin for tests: a broken KV link from this prefill to one decode. Loaded in the
scheduler process by `--plugin tests.disagg.broken_link`. While the file named by
$BATON_TEST_BROKEN_LINK exists, every write of KV pages to the decode whose KV receiver listens
on the port the file holds fails as a broken link would (TransferError); writes to every other
decode, and all writes once the file is gone, are untouched."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from runtime.disagg.transfer.base import TransferError
from runtime.disagg.transfer.tcp import TcpTransfer
from runtime.disagg.wire import AuxRecord

_write = TcpTransfer.write


def _write_unless_broken(self: TcpTransfer, peer_id: str, link: socket.socket,
                         src_pages: list[int], dst_pages: list[int], aux: AuxRecord) -> int:
    flag = os.environ.get("BATON_TEST_BROKEN_LINK")
    port = Path(flag).read_text() if flag and Path(flag).exists() else ""
    if port and link.getpeername()[1] == int(port):
        raise TransferError(f"test fault: the KV link to the decode on port {port} is broken")
    return _write(self, peer_id, link, src_pages, dst_pages, aux)


TcpTransfer.write = _write_unless_broken  # type: ignore[method-assign]
