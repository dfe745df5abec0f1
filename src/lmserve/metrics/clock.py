"""The one clock of the timelines: every stamp in every process comes from `now()`.

`time.monotonic()` is CLOCK_MONOTONIC on Linux and macOS: one system-wide clock, so the engine process's stamps and
the API process's stamps can be subtracted from each other. It never jumps with NTP or the wall clock.
"""

from __future__ import annotations

import time

now = time.monotonic


def wall_time_of(stamp: float) -> float:
    """The Unix time at which `now()` read `stamp` (for logs that people read next to other logs)."""
    return time.time() - (time.monotonic() - stamp)
