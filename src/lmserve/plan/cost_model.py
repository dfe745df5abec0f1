"""Step time as a line in the positions a step computes: made by hand, loaded from JSON, or measured on this machine
with a real model (`lmserve schedule --calibrate`). The schedule explainer and the disaggregation advice price
their iterations with it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from lmserve.engine.request import Request
from lmserve.sampling_params import SamplingParams


@dataclass
class CostModel:
    """Estimated step time = ms_per_step + ms_per_position × positions. Linear: it ignores attention's growth
    with context, so it is an estimate for short contexts, measured on one machine."""

    ms_per_position: float
    ms_per_step: float
    source: str = "hand-made"

    def step_ms(self, positions: int) -> float:
        return self.ms_per_step + self.ms_per_position * positions if positions else 0.0

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
            return cls(float(data["ms_per_position"]), float(data["ms_per_step"]), str(data.get("source", path)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: expected JSON {{ms_per_position, ms_per_step}}: {exc}") from None


def calibrate(model: str, sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 256), repeats: int = 3) -> CostModel:
    """Measures step time against positions on this machine with a real model, and fits a line to it.

    Each sample is one step of `n` positions: a prompt of n tokens (n > 1) or n single-position decodes. Loads the
    model, so it takes seconds and never runs in the test suite.
    """
    import random
    import statistics

    from lmserve import LLM

    budget = max(sizes)
    llm = LLM(model, max_num_batched_tokens=budget, max_num_seqs=budget, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.vocab_size
    ids = iter(range(10**9))

    def add(prompt_len: int, max_tokens: int) -> None:
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(Request(f"calibrate-{next(ids)}", prompt, params))

    def timed_step() -> tuple[int, float]:
        engine.step()
        stats = engine.last_step
        return stats.num_positions, stats.duration_s * 1e3

    samples: list[tuple[int, float]] = []
    add(budget, 1)  # warm-up: first calls allocate buffers and pick kernels
    while engine.has_unfinished_requests():
        engine.step()
    for n in sizes:
        times = []
        for _ in range(repeats):
            if n > 1:  # one prefill of n positions
                add(n, 1)
                times.append(timed_step()[1])
            else:
                add(4, 3)
                timed_step()
                times.append(timed_step()[1])  # one decode
            while engine.has_unfinished_requests():
                engine.step()
        samples.append((n, statistics.median(times)))
    for batch in (4, 16, 32):  # decode batches: n requests × 1 position
        for _ in range(batch):
            add(4, 4)
        timed_step()  # their prefills
        positions, ms = timed_step()
        samples.append((positions, ms))
        while engine.has_unfinished_requests():
            engine.step()
    ms_per_position, ms_per_step = _fit(samples)
    source = f"lmserve schedule --calibrate, model {model}, {time.strftime('%Y-%m-%d')}"
    return CostModel(max(ms_per_position, 0.0), max(ms_per_step, 0.0), source)


def _fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line ms = a + b·positions; returns (b, a)."""
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var if var else 0.0
    return slope, mean_y - slope * mean_x
