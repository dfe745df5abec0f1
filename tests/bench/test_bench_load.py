"""Arrival schedules and the closed/open loop drivers, with a fake request function (no server)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from lmserve.bench.load import arrival_times, run_closed, run_open

RATE, N = 10.0, 2000


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_rate_and_burstiness(burstiness):
    gaps = np.diff(arrival_times(N, RATE, burstiness, seed=0))
    # Gamma(shape=B, scale=1/(R*B)) gaps: mean 1/R, std 1/(R*sqrt(B)); so the mean of N-1 gaps has standard error
    # std/sqrt(N-1) and must land within 4 of them of 0.1 s.
    stderr = 1 / (RATE * math.sqrt(burstiness)) / math.sqrt(len(gaps))
    assert abs(gaps.mean() - 1 / RATE) < 4 * stderr
    # Coefficient of variation 1/sqrt(B): 2 (bursty), 1 (Poisson), 0.5 (regular).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


def test_arrival_schedule_is_seeded():
    assert np.array_equal(arrival_times(100, 5.0, 0.5, seed=7), arrival_times(100, 5.0, 0.5, seed=7))
    assert not np.array_equal(arrival_times(100, 5.0, 0.5, seed=7), arrival_times(100, 5.0, 0.5, seed=8))
    assert arrival_times(3, 5.0)[0] == 0.0
    assert not arrival_times(5, math.inf).any()  # infinite rate: everything at once
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


class InFlight:
    """A fake request function that sleeps and records how many calls overlap."""

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.now, self.peak, self.sent = delays, 0, 0, []

    async def __call__(self, index: int, request: object, scheduled: float | None) -> int:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.sent.append((index, scheduled))
        await asyncio.sleep(self.delays[index % len(self.delays)])
        self.now -= 1
        return index


def clock_from(start: float):
    return lambda: time.perf_counter() - start


def test_closed_loop_never_exceeds_concurrency():
    fake = InFlight([0.001, 0.004, 0.002, 0.0, 0.003])
    done = []
    results = asyncio.run(run_closed(list(range(60)), 4, fake, clock_from(time.perf_counter()), on_done=done.append))
    assert fake.peak == 4  # reached, never exceeded
    assert sorted(results) == list(range(60)) and sorted(done) == list(range(60))
    assert all(scheduled is None for _, scheduled in fake.sent)


def test_closed_loop_time_limit_stops_new_requests():
    fake = InFlight([0.02])
    results = asyncio.run(run_closed(list(range(1000)), 2, fake, clock_from(time.perf_counter()), time_limit=0.1))
    # 2 workers x 20 ms: about 10 requests fit in 0.1 s; in-flight ones finish.
    assert 4 <= len(results) <= 16


def test_open_loop_sends_on_schedule_with_optional_cap():
    arrivals = [0.0, 0.05, 0.05, 0.1, 0.2]
    start = time.perf_counter()
    times: list[float] = []

    async def send(index: int, request: object, scheduled: float | None) -> tuple[int, float | None]:
        times.append(time.perf_counter() - start)
        await asyncio.sleep(0.3)  # longer than the gaps: an open loop must not wait for it
        return index, scheduled

    results = asyncio.run(run_open(list(range(5)), arrivals, send, clock_from(start)))
    assert sorted(results) == list(zip(range(5), arrivals))
    assert all(t >= a - 1e-3 and t < a + 0.05 for t, a in zip(sorted(times), arrivals))

    fake = InFlight([0.01])
    asyncio.run(run_open(list(range(30)), [0.0] * 30, fake, clock_from(time.perf_counter()), max_concurrency=3))
    assert fake.peak == 3


def test_open_loop_time_limit_drops_late_arrivals():
    fake = InFlight([0.0])
    results = asyncio.run(run_open(list(range(5)), [0.0, 0.01, 0.02, 5.0, 6.0], fake,
                                   clock_from(time.perf_counter()), time_limit=1.0))
    assert sorted(results) == [0, 1, 2]
