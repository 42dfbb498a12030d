"""Result files name no path of the machine a bench ran on (bench/portable.py rewrites them as benches write)."""

from __future__ import annotations

import re
import subprocess

from bench.peers import REPO
from bench.portable import portable, portable_text

MACHINE_PATH = re.compile(r"(?:/work|/tmp|/root|/home)/[^\s\"',;)\]]+")


def test_no_result_file_names_a_machine_path() -> None:
    tracked = subprocess.run(["git", "ls-files", "bench/results"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    found = []
    for name in tracked:
        try:
            text = (REPO / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # images
        found += [f"{name}: {m.group(0)}" for m in MACHINE_PATH.finditer(text)]
    assert found == []


def test_paths_a_run_records_become_names_with_the_same_meaning() -> None:
    result = {
        "command": "/home/u/repo/.venv/bin/python -m bench.agent_render_bench --ab-tree /tmp/before --ab-label before",
        "venv": "/opt/peers/vllm033", "binary": "/data/peers/vllm034-src/vllm/vllm-rs",
        "tokenizer": "/home/u/shared/fixtures/qwen3-0.6b", "render_service": "/tmp/other/render_service",
        "tree": "/mnt/checkouts/base", "model": "/tmp/tmp.AbC123/m", "counts": [1, 2], "note": "no path here",
    }
    assert portable(result) == {
        "command": "python -m bench.agent_render_bench --ab-tree <checkout> --ab-label before",
        "venv": "<vLLM 0.33 venv>", "binary": "<vllm-rs>", "tokenizer": "shared/fixtures/qwen3-0.6b",
        "render_service": "<checkout>/render_service", "tree": "<checkout>", "model": "<temporary model dir>",
        "counts": [1, 2], "note": "no path here",
    }
    assert portable_text("written to /root/out/x.json") == "written to $OUT/x.json"
