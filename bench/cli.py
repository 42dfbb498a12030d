"""``splitserve-bench``: render-tier sizing, online serving benchmarks and plots.

    splitserve-bench sizing --base-url http://127.0.0.1:8000 [--base-url http://127.0.0.1:8001 ...]
    splitserve-bench serve --base-url http://127.0.0.1:8000 --dataset-name random --request-rate 1,2,inf
    splitserve-bench plot RESULT.json ... --output plot.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import httpx

from bench.shared_fixtures import QWEN3_DIR

DEFAULT_TOKENIZER = QWEN3_DIR
if not DEFAULT_TOKENIZER.exists():  # a clean checkout carries its own copy next to the repository
    DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "qwen3-0.6b"


def _rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        rate = math.inf if part == "inf" else float(part)
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"request rates must be positive or inf, got {part!r}")
        rates.append(rate)
    if not rates:
        raise argparse.ArgumentTypeError("no request rate given")
    return rates


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def first_model(base_url: str) -> str:
    """The first id /v1/models lists (what vllm bench serve does without --model)."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ------------------------------------------------------------------------------------------------ serve


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="online serving benchmark (vllm bench serve's flags and result keys)")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer.json or a directory with one")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (sharegpt dataset)")
    p.add_argument("--random-input-len", type=_positive_int, default=1024)
    p.add_argument("--random-output-len", type=_positive_int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=_positive_int, default=None)
    p.add_argument("--num-prompts", type=_positive_int, default=1000)
    p.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="requests/s; a comma list sweeps the rates (one result per rate); inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="comma list of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    p.add_argument("--multi-turn", type=_positive_int, default=1,
                   help="N turns per conversation (chat endpoint); reports TTFT by turn")
    p.add_argument("--extra-body", type=_json_object, default=None, help="JSON merged into every request body")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None, help="with a rate sweep, -<rate>qps is added before .json")
    p.add_argument("--label", default=None, help="names this configuration in the result and plots")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="after the run(s), plot the saved results (default file: <result-dir>/<label>-rates.png)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args, parser) -> int:
    from bench import datasets, metrics, plot, serve

    try:
        percentiles = metrics.parse_percentiles(args.metric_percentiles)
        goodput = metrics.parse_goodput(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected if m not in metrics.METRIC_NAMES]
    if unknown:
        parser.error(f"--percentile-metrics: unknown {unknown} (ttft, tpot, itl, e2el)")
    endpoint = "/" + args.endpoint.lstrip("/")
    if args.multi_turn > 1 and not endpoint.endswith("chat/completions"):
        parser.error("--multi-turn needs --endpoint /v1/chat/completions")
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    try:
        if args.dataset_name == "random":
            requests = datasets.random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                                args.random_output_len, args.random_range_ratio, args.seed,
                                                turns=args.multi_turn)
        else:
            if not args.dataset_path:
                parser.error("--dataset-name sharegpt needs --dataset-path")
            requests = datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.seed,
                                                  args.sharegpt_output_len, turns=args.multi_turn)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        model = args.model or first_model(args.base_url)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        parser.error(f"could not list models at {args.base_url}/v1/models ({exc}); pass --model")
    saved: list[Path] = []
    for rate in args.request_rate:
        run = serve.ServeRun(
            base_url=args.base_url.rstrip("/"), model=model, requests=requests, endpoint=endpoint, request_rate=rate,
            burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
            seed=args.seed, multi_turn=args.multi_turn, percentiles=percentiles, selected_metrics=selected,
            goodput=goodput, label=args.label, tokenizer_id=str(args.tokenizer), extra_body=args.extra_body or {},
            show_progress=not args.disable_tqdm)
        print(f"# {args.dataset_name}: {len(requests)} prompts at {rate} req/s, burstiness {args.burstiness}, "
              f"max concurrency {args.max_concurrency}, endpoint {endpoint}", flush=True)
        result = serve.run_benchmark(run)
        result["command"] = "splitserve-bench " + " ".join(args.argv)
        print(serve.summary(result, run), flush=True)
        if args.save_result or args.plot is not None:
            filename = args.result_filename
            if filename and len(args.request_rate) > 1:
                stem = filename[:-5] if filename.endswith(".json") else filename
                filename = f"{stem}-{result['request_rate']}qps.json"
            path = serve.save_result(result, args.result_dir, filename)
            saved.append(path)
            print(f"# wrote {path}", flush=True)
        failed = [e for e in result["errors"] if e]
        if failed:
            print(f"# {len(failed)} failed requests; first error: {failed[0]}", file=sys.stderr)
    if args.plot is not None and saved:
        png = args.plot or str(Path(args.result_dir) / f"{args.label or 'serve'}-rates.png")
        print(f"# wrote {plot.plot_results(saved, png)}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ plot


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="PNG: p99 ITL and median TTFT against request rate, one line per label")
    p.add_argument("results", nargs="+", help="serve result JSON files")
    p.add_argument("--output", "-o", default="serve-rates.png")
    p.add_argument("--itl-percentile", default="p99", help="which ITL key to draw: p99, p90, median ...")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args, parser) -> int:
    from bench import plot

    try:
        print(plot.plot_results(args.results, args.output, args.itl_percentile))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return 0


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    from bench import sizing

    parser = argparse.ArgumentParser(prog="splitserve-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sizing.add_parser(sub)
    add_serve_parser(sub)
    add_plot_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in result files
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
