"""Arrival schedules and the two load models: closed loop (fixed concurrency) and open loop (fixed arrival rate).

They are different experiments (DESIGN.md, Measurement): a closed loop slows its own arrivals when the server slows,
an open loop keeps sending on schedule, so its queueing shows in the tails. The drivers know nothing about HTTP:
they call `send(index, request, scheduled)` and collect what it returns, so tests drive them with fakes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np

Req = TypeVar("Req")
Out = TypeVar("Out")
SendFn = Callable[[int, Req, "float | None"], Awaitable[Out]]
Clock = Callable[[], float]  # seconds since the benchmark started

_ARRIVALS = 3  # numpy stream key, apart from the datasets' (see datasets.py)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (s from the start) of n requests at `rate` req/s; the first goes at 0.

    Gaps are Gamma(shape=B, scale=1/(R*B)) as in vLLM: mean 1/R whatever B, coefficient of variation 1/sqrt(B);
    B = 1 is a Poisson process (exponential gaps), B < 1 burstier, B > 1 more regular. Unlike current vLLM we do
    not rescale the schedule to end at exactly n/R: a Poisson process is what the rate promises.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng([seed, _ARRIVALS])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _expired(clock: Clock, time_limit: float | None) -> bool:
    return time_limit is not None and clock() >= time_limit


async def run_closed(
    requests: Sequence[Req], concurrency: int, send: SendFn, clock: Clock, *, time_limit: float | None = None,
    on_done: Callable[[Out], None] | None = None,
) -> list[Out]:
    """C workers; each sends the next request when its previous one finished, so at most C are in flight."""
    if concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    todo = iter(enumerate(requests))  # shared by the workers; next() never yields, so no lock is needed
    results: list[Out] = []

    async def worker() -> None:
        for index, request in todo:
            if _expired(clock, time_limit):
                return
            result = await send(index, request, None)
            results.append(result)
            if on_done is not None:
                on_done(result)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(1, len(requests))))))
    return results


async def run_open(
    requests: Sequence[Req], arrivals: Sequence[float], send: SendFn, clock: Clock, *,
    max_concurrency: int | None = None, time_limit: float | None = None, on_done: Callable[[Out], None] | None = None,
) -> list[Out]:
    """Send request i at arrivals[i] whatever is outstanding; with a cap, a due request waits for a free slot."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(index: int, request: Req, scheduled: float) -> Out:
        if slots is None:
            result = await send(index, request, scheduled)
        else:
            async with slots:
                result = await send(index, request, scheduled)
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    for index, (request, scheduled) in enumerate(zip(requests, arrivals)):
        if time_limit is not None and scheduled >= time_limit:
            break
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, request, float(scheduled))))
    return list(await asyncio.gather(*tasks))
