"""Ending a server process once it has closed what it holds, without the interpreter's teardown."""

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
