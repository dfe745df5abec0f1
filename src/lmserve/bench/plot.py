"""A one-page picture of a run: latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens/s over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmserve.bench.client import Sample
from lmserve.bench.metrics import token_timeline, tpot


def plot_run(samples: Sequence[Sample], duration: float, path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    ok = [s for s in samples if s.success]
    series = {
        "TTFT": [s.ttft for s in ok if s.ttft is not None],
        "TPOT": [t for t in (tpot(s) for s in ok) if t is not None],
        "ITL": [gap for s in ok for gap in s.itl],
        "E2E latency": [s.e2e for s in ok if s.e2e is not None],
    }
    fig = plt.figure(figsize=(16, 8), layout="constrained")
    grid = fig.add_gridspec(2, 4)
    for column, (name, values) in enumerate(series.items()):
        ax = fig.add_subplot(grid[0, column])
        if values:
            ms = np.sort(np.asarray(values)) * 1000.0
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            for q in (50, 99):
                ax.axvline(np.percentile(ms, q), linestyle=":", color="grey", linewidth=0.8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} CDF (n={len(values)}; p50, p99 dotted)")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[1, :])
    starts, rates = token_timeline(samples, duration)
    ax.bar(starts, rates, width=1.0, align="edge", alpha=0.7)
    ax.set_title("output tokens/s (1 s bins)")
    ax.set_xlabel("s since benchmark start")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)
