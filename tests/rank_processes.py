"""Finding rank processes: each names itself `lmserve-rankN` (/proc/PID/comm), under the process that started it,
directly or through its fork server."""

from __future__ import annotations

from pathlib import Path


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended while read
            pass
    return found


def rank_pids(pid: int) -> list[int]:
    """The ranks below process `pid`, rank 0 first."""
    ranks, below = {}, _children(pid)
    while below:
        child = below.pop()
        below += _children(child)
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("lmserve-rank"):
            ranks[child] = int(name.removeprefix("lmserve-rank"))
    return sorted(ranks, key=ranks.__getitem__)
