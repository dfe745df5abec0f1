"""The one timing helper the benchmark scripts share (they run as scripts, so `from timing import median_ms`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median wall time of fn in milliseconds, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3
