"""bench/engine_overhead.py stays runnable: a CPU dry run on a tiny model."""

import torch

from bench.engine_overhead import main


def test_engine_overhead_bench_runs_on_cpu_and_reports_a_ratio(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = main(["--device", "cpu", "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32",
                    "--batches", "1,2", "--context", "8", "--iters", "2", "--out", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert set(out["batches"]) == {1, 2}
    for r in out["batches"].values():
        assert r["engine_step_ms"] > 0 and r["model_step_ms"] > 0 and r["cuda_graph"] is False
    assert (tmp_path / "r.json").exists()
