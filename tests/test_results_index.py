"""The results index's date and commit of a result: the commit that added the file, through its renames, not an
older file it resembles (git's --follow also follows copies, and a new result is often much like an earlier one)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench import results_index


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00"}
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


def test_a_result_is_dated_by_its_own_commit_through_renames_not_by_a_file_it_resembles(tmp_path, monkeypatch):
    repo = tmp_path
    _git(repo, "init", "-q")
    row = {"case": "decode", "batch": 1, "ms": [5.5 + i / 100 for i in range(40)]}
    (repo / "first.json").write_text(json.dumps(row, indent=1))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first result")
    (repo / "second.json").write_text(json.dumps({**row, "batch": 32}, indent=1))  # much like the first
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "second result")
    second = _git(repo, "rev-parse", "--short", "HEAD").strip()
    _git(repo, "mv", "second.json", "second_renamed.json")
    _git(repo, "commit", "-q", "-m", "a better name")
    monkeypatch.chdir(repo)
    commit, date = results_index.added("second_renamed.json")
    assert commit == second and date == "2026-01-01"
    assert results_index.added("nowhere.json") == ("?", "?")


def test_a_result_cited_by_its_ending_gets_that_line_not_a_line_naming_another_file_that_ends_alike():
    lines = [
        ("docs/a.md", 10, "the plain heap (`agent_render_malloc_second_vllm_rs.json`): 2% more"),
        ("docs/a.md", 20, "unrelated renders (`render_vs_before.json`): level"),
        ("docs/b.md", 5, "in two runs (`extend_rollouts_bodies.json` and `..._bodies_before.json`)"),
        ("docs/b.md", 9, "both orders (`decode_first_vllm_rs.json`, `..._second_vllm_rs.json`)"),
    ]
    assert results_index.cite("extend_rollouts_bodies_before.json", lines)[0] == "docs/b.md:5"
    assert results_index.cite("decode_second_vllm_rs.json", lines)[0] == "docs/b.md:9"
    assert results_index.cite("agent_render_malloc_second_vllm_rs.json", lines)[0] == "docs/a.md:10"
    assert results_index.cite("unknown_result.json", lines) is None


def test_a_result_whose_name_begins_another_cited_name_gets_its_own_line():
    lines = [
        ("docs/a.md", 10, "both block sizes (`step_decode_block_{128,16}.json`)"),
        ("docs/a.md", 30, "a later call (`step_decode_block_128_repeat.json`)"),
        ("docs/a.md", 40, "the run named without its ending: decode_split"),
    ]
    assert results_index.cite("step_decode_block_128.json", lines)[0] == "docs/a.md:10"
    assert results_index.cite("step_decode_block_128_repeat.json", lines)[0] == "docs/a.md:30"
    assert results_index.cite("decode_split.json", lines)[0] == "docs/a.md:40"
