"""Metrics from hand-made samples, against numbers computed by hand (vLLM `bench serve` definitions)."""

from __future__ import annotations

import math

import pytest

from lmserve.bench.client import Sample
from lmserve.bench.metrics import compute_metrics, max_concurrent, meets_slo, parse_slo, token_timeline, tpot


def ok(index: int, start: float, ttft: float, itl: list[float], e2e: float, output_len: int) -> Sample:
    return Sample(index, start, None, prompt_len=10, max_tokens=8, output_len=output_len, ttft=ttft, itl=itl,
                  e2e=e2e, success=True, http_status=200, output_len_source="usage")


@pytest.fixture
def samples() -> list[Sample]:
    return [
        ok(0, 0.0, 0.1, [0.02, 0.04], 0.3, 5),  # TPOT (0.3 - 0.1) / 4 = 0.05
        ok(1, 0.1, 0.2, [0.06], 0.5, 3),  # TPOT (0.5 - 0.2) / 2 = 0.15
        ok(2, 0.2, 0.3, [], 0.3, 1),  # one token: no TPOT
        ok(3, 0.5, 0.4, [0.15, 0.15, 0.1], 1.0, 4),  # TPOT (1.0 - 0.4) / 3 = 0.2
        # A failure and a timeout, with latencies that would wreck every statistic if they leaked in.
        Sample(4, 0.6, None, 10, 8, e2e=0.01, error="HTTP 500: boom", http_status=500),
        Sample(5, 0.0, None, 10, 8, output_len=2, ttft=5.0, itl=[9.0], e2e=10.0, timed_out=True,
               error="timed out"),
    ]


def test_tpot_definition(samples):
    assert [tpot(s) for s in samples[:4]] == pytest.approx([0.05, 0.15, None, 0.2])


def test_hand_computed_metrics(samples):
    m = compute_metrics(samples, duration=2.0)
    assert (m["completed"], m["failed"], m["timed_out"]) == (4, 2, 1)  # vLLM's failed: every unsuccessful one
    assert m["total_input_tokens"] == 40  # 4 successes x 10; the failed ones' prompts do not count
    assert m["total_output_tokens"] == 13  # 5 + 3 + 1 + 4
    assert m["request_throughput"] == pytest.approx(2.0)  # 4 / 2 s
    assert m["output_throughput"] == pytest.approx(6.5)  # 13 / 2 s
    assert m["total_token_throughput"] == pytest.approx(26.5)  # (40 + 13) / 2 s

    # TTFT ms [100, 200, 300, 400]: mean 250, median 250; numpy linear percentiles at rank q/100 * (n-1):
    # p90 rank 2.7 -> 300 + 0.7*100 = 370, p95 rank 2.85 -> 385, p99 rank 2.97 -> 397;
    # population std sqrt((150² + 50² + 50² + 150²) / 4) = sqrt(12500) = 111.803.
    assert [m[f"{s}_ttft_ms"] for s in ("mean", "median", "p90", "p95", "p99", "min", "max")] == pytest.approx(
        [250, 250, 370, 385, 397, 100, 400])
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(12500))

    # TPOT ms [50, 150, 200]: mean 133.333, median 150, p90 rank 1.8 -> 150 + 0.8*50 = 190, p99 rank 1.98 -> 199;
    # std sqrt(((-83.333)² + 16.667² + 66.667²) / 3) = sqrt(3888.889) = 62.361.
    assert [m[f"{s}_tpot_ms"] for s in ("mean", "median", "p90", "p99", "min", "max")] == pytest.approx(
        [400 / 3, 150, 190, 199, 50, 200])
    assert m["std_tpot_ms"] == pytest.approx(math.sqrt(35000 / 9))

    # ITL pooled over requests: [20, 40, 60, 150, 150, 100] ms, sorted [20, 40, 60, 100, 150, 150]:
    # mean 520/6 = 86.667, median (60 + 100)/2 = 80, p90 rank 4.5 -> 150 + 0.5*0 = 150, max 150 (the timed-out
    # request's 9 s gap never enters).
    assert [m[f"{s}_itl_ms"] for s in ("mean", "median", "p90", "min", "max")] == pytest.approx(
        [520 / 6, 80, 150, 20, 150])

    # E2E ms [300, 500, 300, 1000] sorted [300, 300, 500, 1000]: mean 525, median rank 1.5 -> 400,
    # p99 rank 2.97 -> 500 + 0.97*500 = 985.
    assert [m[f"{s}_e2el_ms"] for s in ("mean", "median", "p99", "min", "max")] == pytest.approx(
        [525, 400, 985, 300, 1000])
    assert m["request_goodput"] is None  # no SLO given


def test_goodput(samples):
    # ttft <= 250 and tpot <= 160: #0 (100, 50) and #1 (200, 150) meet both; #2 has TTFT 300 (its TPOT counts as 0,
    # as in vLLM), #3 TTFT 400. 2 good requests / 2 s = 1 req/s.
    m = compute_metrics(samples, 2.0, parse_slo("ttft=250,tpot=160"))
    assert (m["good_completed"], m["request_goodput"]) == (2, pytest.approx(1.0))
    # Adding e2el <= 400 drops #1 (500 ms): 1 good / 2 s.
    m = compute_metrics(samples, 2.0, parse_slo("ttft:250,tpot:160,e2el:400", sep=":"))
    assert (m["good_completed"], m["request_goodput"]) == (1, pytest.approx(0.5))
    # A one-token request meets any TPOT SLO.
    assert meets_slo(samples[2], {"tpot": 0.001, "ttft": 300})


def test_parse_slo_errors():
    assert parse_slo("ttft=500, e2el=2000") == {"ttft": 500.0, "e2el": 2000.0}
    for bad in ("ttft", "foo=1", "ttft=abc", "tpot=-1"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)


def test_empty_and_failed_only_runs_have_no_fake_zeros():
    failed = [Sample(0, 0.0, None, 10, 8, e2e=0.5, error="x")]
    m = compute_metrics(failed, 1.0, {"ttft": 100})
    assert (m["completed"], m["failed"], m["mean_ttft_ms"], m["p99_itl_ms"]) == (0, 1, None, None)
    assert m["request_goodput"] == 0.0


def test_vllm_percentile_keys_usage_input_and_peaks(samples):
    samples[0].usage_prompt_tokens = 25  # the server's count wins over the dataset's 10, as in vLLM
    m = compute_metrics(samples, 2.0, selected_metrics=["ttft", "e2el", "client_queue_time"],
                        selected_percentiles=[50, 99.9], max_concurrency=2)
    assert m["total_input_tokens"] == 55
    assert m["p50_ttft_ms"] == pytest.approx(250) and m["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert m["p50_e2el_ms"] == pytest.approx(400)
    # Closed loop: arrival at 0, so the queue time is the start: [0, 0.1, 0.2, 0.5] s.
    assert m["mean_client_queue_time_ms"] == pytest.approx(200) and m["p50_client_queue_time_ms"] == pytest.approx(150)
    assert "mean_e2el_including_client_queue_ms" not in m  # vLLM writes it only with a finite rate
    assert "p50_tpot_ms" not in m  # not selected
    # Peak: chunks counted one each in 1 s buckets from the first start (0.0): #0 at 0.1, 0.12, 0.16; #1 at 0.3,
    # 0.36; #2 at 0.5; #3 at 0.9, 1.05, 1.2, 1.3 -> 7 in the first second. Concurrency over successes only: at 0.2
    # #0 [0, 0.3), #1 [0.1, 0.6), #2 [0.2, 0.5) -> 3 (the timed-out one no longer counts).
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (7.0, 3)


def test_concurrency_and_timeline(samples):
    # At t=0.2 requests 0 [0, 0.3], 1 [0.1, 0.6], 2 [0.2, 0.5] and the timed-out 5 [0, 10] are all in flight.
    assert max_concurrent(samples) == 4
    starts, rates = token_timeline(samples, duration=2.0)
    assert list(starts) == [0.0, 1.0]
    # #3's chunks come at 0.9, 1.05, 1.2, 1.3 (4 tokens over 4 chunks): 1 in the first second with #0's 5, #1's 3
    # and #2's 1 -> 10 tokens/s; 3 in the second. The timed-out request's chunks do not count.
    assert list(rates) == pytest.approx([10.0, 3.0])
