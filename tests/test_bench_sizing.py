"""splitserve-bench sizing against a real render server process: tables, /proc CPU and the recommendation."""

import json
import math
import os
import sys

import pytest

from bench.cli import main
from bench.sizing import interpolate, listening_pids, recommend
from tests.gateway_harness import Process, free_port
from tests.render_harness import QWEN3_DIR


@pytest.fixture(scope="module")
def render_server():
    port = free_port()
    proc = Process([sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", "qwen3-0.6b", "--reasoning-parser", "qwen3",
                    "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--log-level", "warning"], port)
    try:
        yield proc
    finally:
        proc.stop()


def test_listening_pids_finds_the_server_process(render_server):
    assert render_server.proc.pid in listening_pids(render_server.port)
    assert os.getpid() not in listening_pids(render_server.port)
    assert listening_pids(free_port()) == []


def test_sizing_measures_render_derender_and_recommends(render_server, tmp_path, capsys):
    out = tmp_path / "sizing.json"
    rc = main(["sizing", "--base-url", render_server.url, "--label", "ours", "--prompt-lens", "512,1024",
               "--duration", "0.4", "--concurrency-sweep", "1,2", "--sweep-prompt-len", "512",
               "--derender-tokens", "48", "--chunk-sizes", "1,8", "--parser-configs", "plain,tools",
               "--target-render-rps", "50", "--target-streams", "10", "--stream-tokens-per-s", "20",
               "--target-prompt-len", "768", "--headroom", "0.3", "--workers-per-replica", "2", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (server,) = report["servers"]
    assert server["label"] == "ours" and server["pids"] == [render_server.proc.pid]
    render = server["render"]
    assert [(r["prompt_tokens_target"], r["tools"]) for r in render] == [(512, False), (1024, False), (512, True), (1024, True)]
    for r in render:
        assert abs(r["prompt_tokens"] - r["prompt_tokens_target"]) <= r["prompt_tokens_target"] * 0.01
        assert r["errors"] == 0 and r["requests"] > 0 and r["rps"] > 0
        assert r["server_cpu_ms_per_render"] >= 0 and r["lat_p50_ms"] > 0
    # /proc counts in 10 ms ticks: a single short point may round to zero, all of them together cannot
    assert sum(r["server_cpu_ms_per_render"] for r in render) > 0
    assert render[3]["body_bytes"] > render[1]["body_bytes"]  # the tools travel in the body
    assert [r["concurrency"] for r in server["concurrency_sweep"]] == [1, 2]
    derender = {(r["parser_config"], r["chunk_tokens"]): r for r in server["derender"]}
    assert set(derender) == {("plain", 1), ("plain", 8), ("tools", 1), ("tools", 8)}
    assert derender[("plain", 1)]["chunks"] == 48 and derender[("plain", 8)]["chunks"] == 6
    assert derender[("tools", 1)]["finish_reason"] == "tool_calls"  # the hermes parser saw the call
    assert derender[("plain", 1)]["finish_reason"] == "stop"
    assert derender[("tools", 1)]["request_bytes_per_chunk"] > derender[("plain", 1)]["request_bytes_per_chunk"]
    assert all(r["server_cpu_ms_per_token"] is not None and r["streams"] >= 1 for r in derender.values())
    rec = server["recommendation"]
    assert rec["basis"]["cpu"].startswith("server CPU")
    expected = (rec["render_cores"] + rec["stream_cores"]) / 0.7
    assert rec["cores_with_headroom"] == pytest.approx(expected, abs=0.01)
    assert rec["worker_processes"] == max(1, math.ceil(rec["cores_with_headroom"]))
    assert rec["replicas"] == math.ceil(rec["worker_processes"] / 2)
    assert "RECOMMENDATION (ours)" in capsys.readouterr().out


def test_recommendation_arithmetic():
    rec = recommend(render_ms=5.0, token_ms=0.2, target_rps=200, streams=500, tokens_per_s=40, headroom=0.3,
                    workers_per_replica=4)
    assert rec["render_cores"] == pytest.approx(1.0) and rec["stream_cores"] == pytest.approx(4.0)
    assert rec["worker_processes"] == 8 and rec["replicas"] == 2
    with pytest.raises(ValueError):
        recommend(5.0, 0.2, 1, 1, 1, headroom=1.0, workers_per_replica=1)
    assert interpolate({1000: 2.0, 4000: 5.0}, 2000) == pytest.approx(3.0)
    assert interpolate({1000: 2.0, 4000: 5.0}, 8000) == pytest.approx(10.0)


@pytest.mark.parametrize("argv", [[], ["--base-url", "http://127.0.0.1:9", "--headroom", "1.5"],
                                  ["--base-url", "http://127.0.0.1:9", "--label", "a", "--label", "b"],
                                  ["--launch", "sglang"], ["--base-url", "http://x:1", "--chunk-sizes", "0"],
                                  ["--base-url", "http://x:1", "--parser-configs", "everything"],
                                  ["--base-url", "http://x:1", "--derender-tokens", "8"]])
def test_bad_sizing_flags_exit_with_usage_error(argv):
    with pytest.raises(SystemExit) as info:
        main(["sizing", *argv])
    assert info.value.code == 2


def test_image_cores_add_to_the_recommendation():
    rec = recommend(render_ms=5.0, token_ms=0.0, target_rps=10, streams=0, tokens_per_s=0, headroom=0.5,
                    workers_per_replica=4, image_ms=100.0, images_per_render=4)
    assert rec["image_cores"] == pytest.approx(4.0) and rec["cores_with_headroom"] == pytest.approx(8.1)
    assert rec["worker_processes"] == 9 and rec["replicas"] == 3


def test_sizing_measures_image_renders_on_a_vision_language_server(tmp_path, capsys):
    import shutil
    from pathlib import Path

    bundle = tmp_path / "vl"
    bundle.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_DIR / name, bundle / name)
    for name in ("chat_template.jinja", "config.json", "preprocessor_config.json"):
        shutil.copy(Path(__file__).parent / "fixtures" / "qwen2_5_vl" / name, bundle / name)
    port = free_port()
    proc = Process([sys.executable, "-m", "render_service.cli", "serve", str(bundle), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", "vl", "--image-workers", "1", "--tool-call-parser",
                    "hermes", "--enable-auto-tool-choice", "--log-level", "warning"], port)
    try:
        out = tmp_path / "sizing.json"
        rc = main(["sizing", "--base-url", proc.url, "--label", "vl", "--prompt-lens", "256", "--duration", "0.5",
                   "--concurrency-sweep", "1", "--sweep-prompt-len", "256", "--derender-tokens", "8",
                   "--chunk-sizes", "4", "--parser-configs", "plain", "--target-parser-config", "plain",
                   "--target-chunk-tokens", "4", "--target-prompt-len", "256", "--target-render-rps", "10",
                   "--images-per-render", "2", "--image-resolution", "480p", "--output", str(out)])
    finally:
        proc.stop()
    assert rc == 0
    (server,) = json.loads(out.read_text())["servers"]
    images = server["images"]
    assert images["images_per_render"] == 2 and images["errors"] == 0 and images["requests"] > 0
    assert images["cpu_ms_per_image"] > 0  # decoding and patchifying a 480p image is never free
    rec = server["recommendation"]
    assert rec["images_per_render"] == 2 and rec["cpu_ms_per_image"] == images["cpu_ms_per_image"]
    assert rec["image_cores"] == pytest.approx(10 * 2 * images["cpu_ms_per_image"] / 1e3, abs=1e-3)
    assert "images per render" in capsys.readouterr().out
