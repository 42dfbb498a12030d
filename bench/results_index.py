"""Writes bench/results/INDEX.md: for each result file, the doc line that states its claim (docs/ and README.md
first, then bench/*.py), the date and commit it was added in (git), and the machine it ran on (from its name or
its own fields). Run from the repository root: ``python -m bench.results_index``; it prints the files no doc
cites, which are to be cited or deleted."""

from __future__ import annotations

import json
import os
import re
import subprocess

RESULTS = "bench/results/"
INDEX = RESULTS + "INDEX.md"
HEADER = """# bench/results: what each file backs

One row per result file: the doc line that states its claim (or names the run it belongs to), the file,
the date and commit it was added in, and the machine it was measured on (from its name or its own fields;
the 2-core box is shared and noisy, so its figures are ratios against a baseline of the same run).
A result that no doc cites is deleted; a new one lands with the doc line that cites it and a row here
(`python -m bench.results_index` rewrites this file).

| claim (doc:line: the line) | file | date | machine | commit |
|---|---|---|---|---|
"""
Line = tuple[str, int, str]


def _git(*args: str) -> list[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.split("\n")


def doc_lines() -> list[Line]:
    paths = [p for p in _git("ls-files", "docs", "README.md") + _git("ls-files", "bench/*.py") if p]
    lines: list[Line] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines += [(path, i, line.rstrip()) for i, line in enumerate(f, 1)]
    return lines


def citing_keys(rel: str) -> list[str]:
    """What a doc may write to cite the file, most exact first."""
    if "/" in rel:  # a file of a run's folder: cited as the folder
        folder = rel.split("/")[0]
        return [rel, folder + "/", folder]
    stem = os.path.basename(rel).rsplit(".", 1)[0]
    parts = stem.split("_")
    # "... and _pause0.json", "..._bodies_before.json": the longest ending first, so that a short one
    # ("_before.json") does not take the line of another file that ends the same way
    keys = [rel, stem, *("_" + "_".join(parts[-n:]) + ".json" for n in range(len(parts) - 1, 0, -1))]
    keys += ["_".join(parts[:n]) + "_" for n in range(len(parts) - 1, 2, -1)]  # "..._{a,b}.json", "beside it"
    if len(parts) >= 3:
        keys.append("_".join(parts[:3]) + ".")
    return keys


def cite(rel: str, lines: list[Line]) -> tuple[str, str] | None:
    for key in citing_keys(rel):
        # a key cites the file only where it stands alone: a file's ending ("_before.json") not as the end of
        # another file's name, and its name without ".json" not as the start of another's ("x" in "x_repeat")
        pattern = re.escape(key)
        if key.startswith("_"):
            pattern = r"(?<![A-Za-z0-9_])" + pattern
        if re.match(r"[A-Za-z0-9]", key[-1]):
            pattern += r"(?![A-Za-z0-9_-])"
        alone = re.compile(pattern)
        for path, number, line in lines:
            if key in line and alone.search(line):
                return f"{path}:{number}", line
    return None


def added(path: str) -> tuple[str, str]:
    """(commit, date) of the commit that added the file, following renames. ``--follow`` also follows copies, and a
    new result is often much like an older one: the first commit (newest first) where the file was added or copied
    from another is where it began."""
    commit_date = None
    for row in _git("log", "--follow", "--name-status", "--format=@%h %ad", "--date=short", "--", path):
        if row.startswith("@"):
            commit_date = row[1:].split()
        elif row[:1] in ("A", "C") and commit_date is not None:
            return commit_date[0], commit_date[1]
    return "?", "?"


def excerpt(text: str, width: int = 90) -> str:
    text = re.sub(r"\s+", " ", text.replace("|", "/").replace("`", "")).strip()
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " ..."


def machine(path: str) -> str:
    name = path.lower()
    if "nvidia-h200x2" in name:
        return "2x NVIDIA H200 (16 cores)"
    if "nvidia-h200" in name or "serve_gpu" in name or "1gpu" in name:
        return "NVIDIA H200 (16 cores)"
    if "nvidia-h100" in name:
        return "NVIDIA H100 (16 cores)"
    if "16core" in name:
        return "16-core VM"
    if "2core" in name:
        return "2-core shared VM"
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                text = json.dumps(json.load(f))[:200_000]
        except (OSError, ValueError):
            text = ""
        found = re.search(r'"(?:note|machine|host|device)": "([^"]*(?:core|VM|H100|H200|GPU)[^"]*)"', text)
        if found:
            return excerpt(found.group(1), 60)
        cores = re.search(r'"(?:cpu_count|nproc|cpus)": (\d+)', text)
        if cores:
            return f"{cores.group(1)}-core machine"
    return "2-core shared VM (the dev box; not recorded in the file)"


def main() -> int:
    lines = doc_lines()
    rows, uncited = [], []
    for path in sorted(p for p in _git("ls-files", RESULTS) if p and p != INDEX):
        rel = path[len(RESULTS):]
        found = cite(rel, lines)
        if found is None:
            uncited.append(rel)
        claim = "-" if found is None else f"{found[0]}: {excerpt(found[1])}"
        commit, date = added(path)
        rows.append(f"| {claim} | `{rel}` | {date} | {machine(path)} | {commit} |")
    with open(INDEX, "w", encoding="utf-8") as f:
        f.write(HEADER + "\n".join(sorted(rows)) + "\n")
    for rel in uncited:
        print("cited nowhere:", rel)
    print(f"{INDEX}: {len(rows)} files, {len(uncited)} cited nowhere")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
