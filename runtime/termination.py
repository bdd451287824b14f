"""The container's termination message: why `baton serve` refused to start, where Kubernetes
keeps it.

Kubernetes gives each container a file (`terminationMessagePath`, default /dev/termination-log)
and copies what the process wrote there into the Pod's status (`state.terminated.message`, or
`lastState` once it restarts; at most 4096 bytes), where the operator reads it. A refusal
(exit code 2: a configuration that restarting will not fix) writes its message there. The file
is the kubelet's: it is written only where it already exists, so outside Kubernetes nothing is
written. $BATON_TERMINATION_MESSAGE_PATH names another file (tests, the local pod runner).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/termination-log"
PATH_ENV = "BATON_TERMINATION_MESSAGE_PATH"
MAX_BYTES = 4096  # what the kubelet keeps of one container's message
EXIT_REFUSED = 2  # the configuration can never work: restarting will not help


def termination_path() -> Path:
    return Path(os.environ.get(PATH_ENV) or DEFAULT_PATH)


def write_termination_message(message: str, path: Path | None = None) -> bool:
    """Write `message` (cut to MAX_BYTES) to the termination-message file if it exists;
    whether it was written. Never raises: the refusal itself is already logged."""
    path = path or termination_path()
    if not path.exists():
        return False
    data = message.encode()[:MAX_BYTES].decode(errors="ignore")
    try:
        path.write_text(data)
    except OSError as e:
        log.warning("cannot write the termination message to %s: %s", path, e)
        return False
    return True
