"""PNG plots of serve results: p99 ITL and median TTFT against request rate, one line per label.

Each result JSON is one run at one rate; files that share a ``label`` (or, without one, a file-name stem
with the rate part removed) form one line, so ``collocated`` and ``disaggregated`` sweeps land side by side.
A burst run (rate ``inf``) is drawn to the right of the largest finite rate.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path


def _line_name(path: Path, result: dict) -> str:
    if result.get("label"):
        return str(result["label"])
    return re.sub(r"-?(inf|[0-9.]+)qps.*$", "", path.stem) or path.stem


def _rate(result: dict) -> float:
    rate = result.get("request_rate", "inf")
    return math.inf if rate in ("inf", None) else float(rate)


def load_lines(paths: list[str | Path]) -> dict[str, list[dict]]:
    lines: dict[str, list[dict]] = {}
    for p in paths:
        path = Path(p)
        result = json.loads(path.read_text())
        if "request_rate" not in result or "median_ttft_ms" not in result:
            raise ValueError(f"{path}: not a serve result (no request_rate / median_ttft_ms)")
        lines.setdefault(_line_name(path, result), []).append(result)
    for runs in lines.values():
        runs.sort(key=_rate)
    return lines


def plot_results(paths: list[str | Path], out_png: str | Path, itl_percentile: str = "p99") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = load_lines(paths)
    finite = [_rate(r) for runs in lines.values() for r in runs if not math.isinf(_rate(r))]
    inf_x = (max(finite) * 2 if finite else 1.0)
    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, runs in sorted(lines.items()):
        xs = [inf_x if math.isinf(_rate(r)) else _rate(r) for r in runs]
        itl_key = f"{itl_percentile}_itl_ms"
        ax_itl.plot(xs, [r.get(itl_key, float("nan")) for r in runs], marker="o", label=name)
        ax_ttft.plot(xs, [r["median_ttft_ms"] for r in runs], marker="o", label=name)
    ticks = sorted({inf_x if math.isinf(_rate(r)) else _rate(r) for runs in lines.values() for r in runs})
    has_inf = any(math.isinf(_rate(r)) for runs in lines.values() for r in runs)
    labels = ["inf" if has_inf and t == inf_x else f"{t:g}" for t in ticks]
    for ax, title in ((ax_itl, f"{itl_percentile.upper()} ITL (ms)"), (ax_ttft, "Median TTFT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(ticks, labels)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
