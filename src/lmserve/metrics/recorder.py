"""Where finished requests and engine steps go: Prometheus, the request log, and a window of recent ones."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from lmserve.metrics.prometheus import PrometheusMetrics
from lmserve.metrics.request_log import RequestLog
from lmserve.metrics.stats import RequestTimeline, StepRecord

RECENT_REQUESTS = 512
# Spans kept at each end of a recent request's timeline: 512 requests of 32k steps each held ~2 GB of spans; compacted
# they hold ~130 spans each. Prometheus and the request log see the whole timeline first.
KEPT_SPANS = 64
RECENT_STEPS = 2048


class StatsRecorder:
    def __init__(self, model_name: str, request_log: str | RequestLog | None = None) -> None:
        """`request_log`: a file's path, or the RequestLog of another model's recorder (one log for a server)."""
        self.prometheus = PrometheusMetrics(model_name)
        self.request_log = request_log if isinstance(request_log, RequestLog) or request_log is None \
            else RequestLog(request_log) if request_log else None
        self.recent_requests: deque[RequestTimeline] = deque(maxlen=RECENT_REQUESTS)
        self.recent_steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self.num_recorded = 0

    def on_step(self, step: StepRecord) -> None:
        self.prometheus.observe_step(step)
        self.recent_steps.append(step)

    def record(self, timelines: Iterable[RequestTimeline]) -> None:
        """Called once per engine request, when its response is done (last byte written, or aborted)."""
        for timeline in timelines:
            self.prometheus.observe_request(timeline)
            if self.request_log is not None:
                self.request_log.write(timeline)
            self.recent_requests.append(timeline.compacted(KEPT_SPANS))
            self.num_recorded += 1

    def close(self) -> None:
        if self.request_log is not None:
            self.request_log.close()
