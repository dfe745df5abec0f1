"""`--request-log FILE`: one JSON line per finished engine request, with every stamp of its timeline."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmserve.metrics.stats import RequestTimeline

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: each finished request is on disk when its line is written, even if the server is killed.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the server

    def write(self, timeline: RequestTimeline) -> None:
        try:
            self._file.write(json.dumps(timeline.to_dict(), separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk must not fail requests; the log says what was lost
            logger.error("cannot write the request log %s: %s", self.path, exc)

    def close(self) -> None:
        self._file.close()
