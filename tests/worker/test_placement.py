"""Thread placement: CPU lists, and what apply_placement does to this process (restored afterwards)."""

from __future__ import annotations

import os

import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from lmserve.config import PlacementConfig, make_engine_config
from lmserve.config_values import parse_cpus
from lmserve.worker.placement import apply_placement


def test_parse_cpus() -> None:
    assert parse_cpus("1") == [1]
    assert parse_cpus("0-3") == [0, 1, 2, 3]
    assert parse_cpus("3,0-1,1") == [0, 1, 3]
    assert parse_cpus(None) is None and parse_cpus("") is None
    for bad in ("x", "-1", "1-", ",", "3-1", "8192", "0-99999999999"):  # the last would be a list of 10^11 ids
        with pytest.raises(ValueError):
            parse_cpus(bad)
    assert make_engine_config(engine_cpus="0", engine_threads=1).placement == PlacementConfig(1, [0])


def blas_threads() -> int:
    return max(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")


def test_apply_placement_pins_and_sizes_pools() -> None:
    affinity, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpu = min(affinity)
    try:
        with threadpool_limits(limits=None):  # restores the BLAS pools on exit
            assert apply_placement(PlacementConfig(engine_threads=1, engine_cpus=[cpu]), True) == 1
            assert os.sched_getaffinity(0) == {cpu}
            assert blas_threads() == 1 and torch.get_num_threads() == 1
            os.sched_setaffinity(0, affinity)
            # Without a thread count: one per allowed CPU, and torch gets them when it does the matmuls itself.
            assert apply_placement(PlacementConfig(), blas_does_matmuls=False) == len(affinity)
            assert torch.get_num_threads() == len(affinity)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(torch_threads)


def test_cpus_the_process_may_not_use_are_refused_before_it_pins_anything() -> None:
    affinity = os.sched_getaffinity(0)
    absent = max(affinity) + 1
    with pytest.raises(ValueError, match=f"engine_cpus: CPU\\(s\\) {absent} are not among this process's CPUs"):
        apply_placement(PlacementConfig(engine_cpus=[min(affinity), absent]), True)
    assert os.sched_getaffinity(0) == affinity
    # A configuration for another machine's CPUs is made without complaint: it is checked where it is applied.
    assert PlacementConfig(engine_cpus=[absent]).engine_cpus == [absent]
    for bad in ({"engine_threads": 0}, {"engine_threads": 1025}, {"engine_cpus": []}, {"engine_cpus": [-1]}):
        with pytest.raises(ValueError):
            PlacementConfig(**bad)
