"""splitserve-bench serve and plot end to end: a real tiny engine and gateway as processes on loopback."""

import json
import math

import pytest

from bench.cli import main
from tests.gateway_harness import QWEN3_TOKENIZER, engine_process, gateway_process
from token_engine.models.random_model import write_random_model

VLLM_KEYS = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
             "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "latencies", "errors",
             "generated_texts", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
             "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
             "p50_e2el_ms"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = write_random_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", preset="tiny",
                               overrides={"tie_word_embeddings": False}, tokenizer_dir=QWEN3_TOKENIZER,
                               dtype="float32")
    engine = engine_process(model)
    try:
        gw = gateway_process(model, ["--engine", engine.url])
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        engine.stop()


def _results(directory):
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def test_random_sweep_writes_vllm_result_keys_and_a_plot(gateway, tmp_path, capsys):
    rc = main(["serve", "--base-url", gateway.url, "--dataset-name", "random", "--random-input-len", "24",
               "--random-output-len", "6", "--num-prompts", "6", "--request-rate", "20,inf", "--ignore-eos",
               "--seed", "1", "--max-concurrency", "4", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--goodput", "ttft:60000", "tpot:60000", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "run.json", "--label", "collocated",
               "--plot", str(tmp_path / "rates.png"), "--disable-tqdm"])
    assert rc == 0
    results = _results(tmp_path)
    assert set(results) == {"run-20.0qps.json", "run-infqps.json"}
    burst = results["run-infqps.json"]
    assert VLLM_KEYS <= set(burst)
    assert burst["request_rate"] == "inf" and results["run-20.0qps.json"]["request_rate"] == 20.0
    assert burst["completed"] == 6 and burst["failed"] == 0 and burst["errors"] == [""] * 6
    assert burst["output_lens"] == [6] * 6  # --ignore-eos: every request runs to max_tokens
    assert burst["total_output_tokens"] == 36
    assert all(12 <= n <= 24 for n in burst["input_lens"])  # the server's prompt token count
    # a chunk may carry two tokens when the detokenizer holds back half a UTF-8 character
    assert all(1 <= len(itl) <= 5 for itl in burst["itls"])
    assert 0 < burst["median_ttft_ms"] <= burst["mean_e2el_ms"]
    assert burst["p99_itl_ms"] >= burst["p50_itl_ms"] > 0
    assert burst["request_goodput"] == pytest.approx(burst["request_throughput"])  # SLOs that everything meets
    # --max-concurrency 4: no request starts while four others are in flight
    spans = list(zip(burst["start_times"], burst["latencies"]))
    assert max(sum(1 for s, lat in spans if s <= t < s + lat) for t, _ in spans) <= 4
    assert 1 <= burst["max_concurrent_requests"] <= 6  # vLLM's per-second buckets, coarser than the gate
    assert burst["label"] == "collocated" and burst["command"].startswith("splitserve-bench serve")
    assert (tmp_path / "rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 ITL (ms)" in out


def test_multi_turn_chat_reports_ttft_by_turn(gateway, tmp_path):
    # short turns: the test engine's context is 256 tokens
    convo = [{"from": f, "value": v} for f, v in [
        ("human", "what makes the sky look blue"), ("gpt", "light scattering in the air"),
        ("human", "and why are sunsets red then"), ("gpt", "longer paths through the air"),
        ("human", "does the same happen on mars"), ("gpt", "dust there makes sunsets blue")]]
    dataset = tmp_path / "data" / "short.json"
    dataset.parent.mkdir()
    dataset.write_text(json.dumps([{"conversations": convo}, {"conversations": convo[2:] + convo[:2]}]))
    rc = main(["serve", "--base-url", gateway.url, "--endpoint", "/v1/chat/completions", "--dataset-name",
               "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", "4",
               "--num-prompts", "2", "--multi-turn", "3", "--request-rate", "inf", "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert rc == 0
    (result,) = _results(tmp_path).values()
    assert result["backend"] == "openai-chat" and result["multi_turn"] == 3
    assert result["completed"] == 6 and result["turns"] == [1, 2, 3, 1, 2, 3]
    assert set(result["ttft_by_turn"]) == {"1", "2", "3"}
    assert all(t["completed"] == 2 and t["median_ttft_ms"] > 0 for t in result["ttft_by_turn"].values())
    # each turn resends the conversation so far: the server counts a longer prompt every turn
    lens = result["input_lens"]
    assert lens[0] < lens[1] < lens[2] and lens[3] < lens[4] < lens[5]


def test_failed_requests_are_counted_not_raised(gateway, tmp_path):
    rc = main(["serve", "--base-url", gateway.url, "--model", "no-such-model", "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "2", "--save-result", "--result-dir", str(tmp_path),
               "--disable-tqdm"])
    assert rc == 0
    (result,) = _results(tmp_path).values()
    assert result["completed"] == 0 and result["failed"] == 2
    assert all(e.startswith("HTTP 404") for e in result["errors"])
    assert math.isclose(result["mean_ttft_ms"], 0.0)


@pytest.mark.parametrize("argv", [
    ["--goodput", "ttft"], ["--percentile-metrics", "ttft,speed"], ["--request-rate", "0"],
    ["--multi-turn", "2"], ["--dataset-name", "sharegpt"], ["--metric-percentiles", "200"],
])
def test_bad_flags_exit_with_usage_error(argv):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1", *argv])
    assert info.value.code == 2


def test_unreachable_server_without_model_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--random-input-len", "4"])
    assert info.value.code == 2


def test_plot_refuses_files_that_are_not_serve_results(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit) as info:
        main(["plot", str(bad), "--output", str(tmp_path / "p.png")])
    assert info.value.code == 2
