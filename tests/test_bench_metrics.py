"""bench.metrics: vLLM's serving metric definitions, goodput and the result keys."""

import math

import numpy as np
import pytest

from bench.metrics import (
    RequestOutput,
    calculate_metrics,
    format_summary,
    parse_goodput,
    parse_percentiles,
    ttft_by_turn,
)
from bench.serve import arrival_delays


def _out(ttft, itl, latency, tokens, prompt=10, start=0.0, turn=1, success=True):
    return RequestOutput(success=success, prompt_len=prompt, output_tokens=tokens, ttft=ttft, itl=list(itl),
                         latency=latency, start_time=start, turn=turn)


def test_metrics_match_hand_computed_values():
    outputs = [_out(0.1, [0.02, 0.04], 0.16, 3, prompt=10), _out(0.3, [0.05], 0.35, 2, prompt=20, start=0.5),
               _out(0, [], 0, 0, prompt=99, success=False)]
    m = calculate_metrics(outputs, 2.0, [50, 99], ["ttft", "tpot", "itl", "e2el"], {})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300], 99))
    # TPOT = (latency - ttft) / (tokens - 1): 0.03 and 0.05
    assert m["mean_tpot_ms"] == pytest.approx(40.0)
    assert m["mean_itl_ms"] == pytest.approx(1e3 * (0.02 + 0.04 + 0.05) / 3)
    assert m["p50_e2el_ms"] == pytest.approx(255.0)
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    outputs = [_out(0.1, [0.02], 0.12, 2), _out(0.3, [0.02], 0.32, 2), _out(0.1, [0.5], 0.6, 2)]
    m = calculate_metrics(outputs, 1.0, [99], ["ttft"], parse_goodput(["ttft:200", "tpot:100"]))
    assert m["request_goodput"] == pytest.approx(1.0)
    assert "mean_tpot_ms" not in m  # only selected metrics get keys


def test_peak_tokens_and_concurrency_by_second():
    outputs = [_out(0.1, [0.1, 0.1], 0.3, 3, start=100.0), _out(0.2, [0.1], 1.5, 2, start=100.1)]
    m = calculate_metrics(outputs, 2.0, [99], ["ttft"], {})
    assert m["max_output_tokens_per_s"] == 5.0
    assert m["max_concurrent_requests"] == 2


@pytest.mark.parametrize("bad", [["ttft"], ["latency:5"], ["ttft:-1"], ["tpot:abc"], ["e2el:inf"]])
def test_bad_goodput_is_refused(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


@pytest.mark.parametrize("bad", ["", "0", "101", "50,x"])
def test_bad_percentiles_are_refused(bad):
    with pytest.raises(ValueError):
        parse_percentiles(bad)


def test_percentile_keys_follow_vllm_naming():
    m = calculate_metrics([_out(0.1, [0.01], 0.11, 2)], 1.0, parse_percentiles("50,99.9"), ["itl"], {})
    assert {"p50_itl_ms", "p99.9_itl_ms", "std_itl_ms"} <= set(m)


def test_ttft_by_turn_groups_turns():
    outputs = [_out(0.2, [], 0.2, 1, turn=1), _out(0.4, [], 0.4, 1, turn=1), _out(0.1, [], 0.1, 1, turn=2)]
    table = ttft_by_turn(outputs, [99])
    assert table["1"]["median_ttft_ms"] == pytest.approx(300.0)
    assert table["2"]["completed"] == 1 and table["2"]["mean_ttft_ms"] == pytest.approx(100.0)
    summary = format_summary({**calculate_metrics(outputs, 1.0, [99], ["ttft"], {}), "ttft_by_turn": table},
                             ["ttft"], [99])
    assert "Turn 2" in summary and "P99 TTFT" in summary


def test_poisson_arrivals_have_the_requested_mean_and_burst_is_all_at_once():
    gaps = arrival_delays(4000, 20.0, 1.0, seed=1)
    assert gaps[0] == 0.0
    assert np.mean(gaps[1:]) == pytest.approx(1 / 20.0, rel=0.1)
    bursty = arrival_delays(4000, 20.0, 0.25, seed=1)
    assert np.std(bursty[1:]) > 1.5 * np.std(gaps[1:])  # gamma shape < 1: same mean, more spread
    assert arrival_delays(5, math.inf, 1.0, 0) == [0.0] * 5
    assert arrival_delays(3, 2.0, 1.0, 7) == arrival_delays(3, 2.0, 1.0, 7)
    with pytest.raises(ValueError):
        arrival_delays(3, 2.0, 0.0, 0)
