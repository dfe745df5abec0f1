"""Ending a server process once it has closed what it holds, without the interpreter's teardown; whether another
process of this machine still lives."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_closed(code: int) -> NoReturn:
    """Exits with `code` at once: logs and standard streams flushed, no atexit handlers, no module teardown.

    Only for a process that has already closed its sockets, ranks and files itself. Python's teardown of a process
    that imported torch frees every module's objects one by one: ~0.4 s of CPU for the engine here, paid by each
    rank and again by the API process, on every stop of every server.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)


def process_alive(pid: int) -> bool:
    """Whether a process of this machine with that pid exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
