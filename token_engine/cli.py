"""`token-engine serve MODEL_DIR` (vLLM's flag names) and `token-engine make-random-model OUT`."""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any

from splitserve_common import vllm_flags, vllm_serve_flags
from splitserve_common.auth import add_api_key_argument
from splitserve_common.block_hashes import HASH_ALGOS
from splitserve_common.cli_args import json_object_arg
from splitserve_common.connection_timeouts import add_header_timeout_argument
from splitserve_common.hf_cache import resolve_model
from splitserve_common.output_parsers import ParserFlags
from token_engine.core.step_budget import PrefillPolicy

if TYPE_CHECKING:
    from token_engine.core.engine import EngineConfig

log = logging.getLogger("token_engine.cli")

# vLLM flags that configure what this engine never does: it runs no model code.
NOOP_FLAGS = (
    vllm_flags.TRUST_REMOTE_CODE,
    vllm_flags.NoOpFlag("--enable-scale-out", "/inference/v1/generate is always served"),
    vllm_flags.NoOpFlag("--disable-log-stats", "the engine logs no periodic stats; /metrics is unchanged"),
    vllm_flags.NoOpFlag("--enable-server-load-tracking", "GET /load always counts requests in flight"),
)
KV_CACHE_DTYPES = ["auto", "bfloat16", "float16", "float32", "half", "float", "fp8", "fp8_e4m3", "fp8_e5m2"]
LOGPROBS_MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def prefill_policy_from_args(args) -> PrefillPolicy:
    if not 0.0 <= args.cache_aware_admission_threshold <= 1.0:
        raise SystemExit("--cache-aware-admission-threshold must be within [0, 1]")
    if args.target_step_ms < 0 or args.long_prefill_token_threshold < 0 or args.cache_aware_admission_window < 0:
        raise SystemExit("--target-step-ms, --long-prefill-token-threshold and --cache-aware-admission-window "
                         "must not be negative")
    return PrefillPolicy(
        target_step_ms=args.target_step_ms,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        max_num_inflight_kv_loads=args.max_num_inflight_kv_loads,
        cache_aware_admission_window=args.cache_aware_admission_window,
        cache_aware_admission_threshold=args.cache_aware_admission_threshold,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="token-engine", description="Tokens-only LLM engine (token IDs in and out).")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve /inference/v1/generate for a model directory")
    s.add_argument("model", help="Hugging Face model directory (config.json + safetensors)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    # vLLM's default (every interface), so manifests written for vLLM reach us; without --api-key it warns.
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    add_api_key_argument(s, "/health, /ping, /load, /version, /metrics")
    add_header_timeout_argument(s)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API answers to; the first is reported (default: the model path)")
    s.add_argument("--max-model-len", type=_positive_int, default=None)
    s.add_argument("--max-num-seqs", type=_positive_int, default=256)
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="per-step token budget (prefill chunks + decode tokens)")
    s.add_argument("--block-size", type=_positive_int, default=16)
    s.add_argument("--target-step-ms", type=float, default=0.0,
                   help="stall-free chunked prefill: while sequences decode, a step takes only the tokens that keep "
                        "it near this time (fitted from the steps run); prefill chunks fill what decode leaves. "
                        "0: off")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prompt's chunk per step is at most this many tokens unless it is the only request "
                        "(vLLM's meaning); 0: off")
    s.add_argument("--long-prefill-token-threshold-adaptive", action="store_true",
                   help="the cap above never falls below max-num-batched-tokens / (running + waiting)")
    s.add_argument("--max-num-inflight-kv-loads", type=_positive_int, default=None,
                   help="most requests holding blocks for an asynchronous KV load at once")
    s.add_argument("--cache-aware-admission-window", type=int, default=0,
                   help="within the first N waiting requests, those with a cached prefix start first")
    s.add_argument("--cache-aware-admission-threshold", type=float, default=0.5,
                   help="KV cache usage from which the window above applies")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None,
                   help="number of KV blocks (CPU or GPU), overriding the memory-based sizing")
    s.add_argument("--kv-cache-memory-bytes", type=_positive_int, default=None,
                   help="KV cache size in bytes (CPU default: enough for 8 full-length sequences, at most 4 GiB)")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256",
                   help="vLLM's block hash for KV events (with --block-size and $PYTHONHASHSEED): routers "
                        "recompute it from token ids")
    s.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps without CUDA graphs")
    s.add_argument("--max-logprobs", type=int, default=20)
    s.add_argument("--enable-prompt-tokens-details", action="store_true")
    s.add_argument("--generate-logprobs-format", choices=["ids", "token_id_strings"], default="ids",
                   help="logprobs shape on /inference/v1/generate: integer ids (newer vLLM) or 'token_id:N' strings")
    s.add_argument("--kv-transfer-config", type=json_object_arg, default=None,
                   help='KV connector config as JSON, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'')
    s.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory for KV blocks evicted from the device pool, reloaded on a prefix hit "
                        "instead of recomputed (vLLM's flag; or OffloadingConnector in --kv-transfer-config)")
    s.add_argument("--kv-offloading-backend", choices=("native", "lmcache"), default=None,
                   help="vLLM's flag: 'native' (host memory, the default) is served; lmcache is refused")
    s.add_argument("--kv-events-config", type=json_object_arg, default=None,
                   help='KV events for routers as JSON (vLLM\'s keys), e.g. \'{"enable_kv_cache_events":true,'
                        '"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}\'')
    s.add_argument("--kv-side-channel-secret", default=None,
                   help="shared secret of the NIXL side channel's HMAC handshake, the same on every engine "
                        "(default: $SPLITSERVE_KV_SECRET; prefer the variable: flags show in ps)")
    s.add_argument("--kv-allowed-peers", default=None,
                   help="comma-separated hosts/CIDRs this engine may fetch KV from (default: "
                        "$SPLITSERVE_KV_ALLOWED_PEERS, else loopback only), e.g. 127.0.0.1/32,10.0.0.0/8")
    s.add_argument("--tokens-only", action="store_true",
                   help="as vLLM: never detokenize, so output_mode text and derender are refused (without it the "
                        "tokenizer is still loaded only by the first request that needs text)")
    s.add_argument("--skip-tokenizer-init", action="store_true",
                   help="as vLLM: no tokenizer, so output_mode text and derender are refused (as --tokens-only)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-format", default="text", choices=["json", "text"],
                   help="json: one object per line (ts, level, logger, msg, request_id, fields)")
    s.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                   help="seconds a grammar may compile before its worker is killed and the request gets a 400")
    s.add_argument("--structured-outputs-compile-workers", type=_positive_int, default=2,
                   help="grammar-compile worker processes (one client may use all but one of them)")
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests and held KV leases may take before exit")
    _add_vllm_flags(s)

    pf = sub.add_parser("preflight", add_help=False,
                        help="check the KV transfer path (NIXL/UCX) between two local agents; --help for options")
    pf.add_argument("preflight_args", nargs=argparse.REMAINDER)

    r = sub.add_parser("make-random-model", help="write a random-weight model directory (no hub access)")
    r.add_argument("out")
    r.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "mistral"], default="qwen3")
    r.add_argument("--preset", default="tiny",
                   help="tiny, qwen2.5-7b, ... (see token_engine.models.random_model.PRESETS)")
    r.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied in")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--overrides", type=json_object_arg, default=None, help="config.json keys to override, as JSON")

    w = sub.add_parser("with-random-weights",
                       help="print a cached copy of a weightless bundle (tokenizer + config) with random weights")
    w.add_argument("bundle", help="model directory with config.json (e.g. the render tier's default bundle)")
    w.add_argument("--seed", type=int, default=0)
    return parser


def _add_vllm_flags(s: argparse.ArgumentParser) -> None:
    """vLLM's serve flags: those that map onto this engine, then the no-ops; see docs/token-engine.md."""
    s.add_argument("--revision", default=None, help="model revision (branch, tag or commit) for a model id")
    s.add_argument("--tokenizer", default=None,
                   help="directory or model id whose tokenizer.json gives structured outputs the vocabulary "
                        "(default: the model's)")
    s.add_argument("--generation-config", default="auto",
                   help="'auto': EOS ids from the model's generation_config.json; 'vllm': from config.json only; "
                        "or a directory holding the generation_config.json to use")
    s.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None,
                   help="priority: lower 'priority' first, then arrival; fcfs: arrival only, and a request with "
                        "a non-zero priority is refused as vLLM does (default: priority order, which is "
                        "arrival order when every priority is 0)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill is always chunked under --max-num-batched-tokens (the flag is accepted)")
    s.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache is kept in the model dtype: 'auto' or that dtype's name")
    s.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                   help="raw_logprobs: the model's log-softmax before sampling parameters; raw_logits: its logits "
                        "(the processed_* modes are refused)")
    s.add_argument("--enable-rl-control", action=argparse.BooleanOptionalAction, default=None,
                   help="the trainer routes (pause/resume, abort_requests, weight transfer, sleep; docs/rl.md); "
                        "default: on when VLLM_SERVER_DEV_MODE=1, as vLLM")
    s.add_argument("--reasoning-parser", default=None,
                   help="output_mode derender: the reasoning parser (vLLM's names), run by the installed output "
                        "parsers (the render tier's, found through the splitserve.output_parsers entry point)")
    s.add_argument("--tool-call-parser", default=None, help="output_mode derender: the tool call parser")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="output_mode derender: parse tool calls for tool_choice auto")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log each request as it arrives (id, prompt length, sampling parameters)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    vllm_flags.add_uvicorn_log_level(s)
    vllm_flags.add_parallel_flags(s)
    vllm_flags.add_noop_flags(s, NOOP_FLAGS)
    vllm_flags.add_tls_and_hub_flags(s)
    vllm_serve_flags.add_vllm_flags(s)


def vllm_flag_errors(args: argparse.Namespace) -> str | None:
    """One line refusing a vLLM flag value this engine cannot honour, or None."""
    error = vllm_flags.parallelism_error(args, "the engine")
    if error:
        return error
    if args.logprobs_mode.startswith("processed"):
        return (f"--logprobs-mode {args.logprobs_mode} is not supported: use raw_logprobs (the model's log-softmax "
                f"before temperature, penalties and top-k/top-p) or raw_logits")
    if args.kv_cache_dtype.startswith("fp8"):
        return f"--kv-cache-dtype {args.kv_cache_dtype} is not supported: the KV cache is kept in the model dtype"
    return None


def parser_flags_from_args(args: argparse.Namespace) -> ParserFlags:
    """The parser flags for output_mode derender; logged when nothing installed can honour them (derender is then
    refused with a 400 naming them, never answered unparsed)."""
    from splitserve_common.output_parsers import find_output_parsers

    flags = ParserFlags(args.reasoning_parser, args.tool_call_parser, bool(args.enable_auto_tool_choice))
    if flags.has_parsers and find_output_parsers() is None:
        log.warning("--reasoning-parser/--tool-call-parser: no output parsers are installed (entry point group "
                    "splitserve.output_parsers), so output_mode derender will be refused; tokens and text work")
    return flags


def resolve_model_args(args: argparse.Namespace) -> None:
    """The model (and --tokenizer) as a directory: a model id is looked up in the Hugging Face cache, else
    downloaded. A model id is served under that id by default, as vLLM does (ModelNotFound on failure)."""
    model = resolve_model(args.model, args.revision, weights=True)
    args.model = model.directory
    if model.from_hub and not args.served_model_name:
        args.served_model_name = [model.name]
    if args.tokenizer:
        args.tokenizer = resolve_model(args.tokenizer, None, weights=False).directory


def check_model_dir(args: argparse.Namespace) -> None:
    """A model directory the engine can load, and a --kv-cache-dtype it can keep (ValueError, one line)."""
    from pathlib import Path

    from token_engine.models import parse_dtype, read_arch
    from token_engine.models.loader import checkpoint_files

    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} has no config.json (not a Hugging Face model directory)")
    checkpoint_files(args.model)  # FileNotFoundError: no safetensors weights
    if args.generation_config not in ("auto", "vllm"):
        if not (Path(args.generation_config) / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {args.generation_config}: no generation_config.json there")
    if args.kv_cache_dtype != "auto":
        dtype = read_arch(args.model, dtype=None if args.dtype == "auto" else args.dtype).dtype
        if parse_dtype(args.kv_cache_dtype) != dtype:
            raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported with a "
                             f"{str(dtype).removeprefix('torch.')} model: the KV cache is kept in the model dtype "
                             f"(use auto)")


def check_kv_transfer_config(args: argparse.Namespace) -> None:
    from token_engine.kv_offload.config import MULTI_CONNECTOR, split_connectors

    pd, _ = split_connectors(args.kv_transfer_config)
    if pd is not None and pd.get("kv_connector") == "NixlConnector":
        from token_engine.kv_connector.config import parse_nixl_config

        extra = dict(pd.get("kv_connector_extra_config") or {})
        for key, value in (("kv_side_channel_secret", args.kv_side_channel_secret),
                           ("kv_allowed_peers", args.kv_allowed_peers)):
            if value is not None:
                extra[key] = value
        if extra:
            pd = {**pd, "kv_connector_extra_config": extra}
            if args.kv_transfer_config.get("kv_connector") == MULTI_CONNECTOR:  # put it back in the list
                outer = args.kv_transfer_config
                subs = [pd if c.get("kv_connector") == "NixlConnector" else c
                        for c in outer["kv_connector_extra_config"]["connectors"]]
                args.kv_transfer_config = {**outer, "kv_connector_extra_config": {
                    **outer["kv_connector_extra_config"], "connectors": subs}}
            else:
                args.kv_transfer_config = pd
        parse_nixl_config(pd)  # a bad key is a one-line error here, not a traceback later


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from token_engine.core.engine import EngineConfig  # torch: not imported for a command line refused early

    check_kv_transfer_config(args)
    if args.kv_offloading_size is not None or args.kv_offloading_backend is not None or args.kv_transfer_config:
        from token_engine.kv_offload.config import host_tier_bytes

        # sizes are checked against one block once the model is read; the keys and backend are checked here
        host_tier_bytes(args.kv_transfer_config, args.kv_offloading_size, args.kv_offloading_backend,
                        args.block_size, 1)
    if args.kv_events_config is not None:  # a bad key is a one-line error here, not a traceback later
        from token_engine.kv_events.config import parse_kv_events_config

        parse_kv_events_config(args.kv_events_config)
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        device=args.device,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_policy=prefill_policy_from_args(args),
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        max_logprobs=args.max_logprobs,
        kv_transfer_config=args.kv_transfer_config,
        kv_events_config=args.kv_events_config,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        tokenizer=getattr(args, "tokenizer", None),
        generation_config=getattr(args, "generation_config", "auto"),
        logprobs_mode=getattr(args, "logprobs_mode", "raw_logprobs"),
        structured_outputs_compile_timeout_s=args.structured_outputs_compile_timeout,
        structured_outputs_compile_workers=args.structured_outputs_compile_workers,
    )


def serve(config: EngineConfig, host: str, port: int, *, sock: socket.socket | None = None,
          enable_prompt_tokens_details: bool = False, logprobs_format: str = "ids", log_level: str = "info",
          shutdown_grace_seconds: float = 30.0, access_log: bool = True, log_requests: bool = False,
          scheduling_policy: str | None = None, api_keys: list[str] | None = None,
          header_timeout_s: float = 10.0, tls: dict[str, Any] | None = None,
          rl_control: bool | None = None, tokens_only: bool = False, parser_flags: ParserFlags | None = None) -> None:
    import uvicorn

    from splitserve_common.auth import ApiKeys, warn_if_open
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.lifecycle import DrainingServer, Lifecycle, wrap_app
    from token_engine.core.engine import AsyncEngine, LLMEngine
    from token_engine.http.openapi import engine_openapi
    from token_engine.http.server import VERSION, build_app

    keys = ApiKeys(api_keys)
    connection_settings = uvicorn_connection_settings(header_timeout_s) | (tls or {})
    try:
        llm = LLMEngine(config)
    except (ValueError, OSError):
        raise
    except Exception as exc:  # a corrupt checkpoint (SafetensorError), a device that fails: one line as well
        log.debug("engine start-up failed", exc_info=True)
        raise ValueError(f"cannot start the engine on {config.model}: {type(exc).__name__}: {exc}") from None
    engine = AsyncEngine(llm)
    engine.start()
    # The first structured request must not wait 10-30 s for the vocabulary and the compile workers: in P/D
    # that wait would run into the prefill's KV lease.
    engine.engine.grammars.warm_up()
    try:
        sock = sock if sock is not None else _bind(host, port)
    except OSError:
        engine.shutdown()
        raise
    # Warned once the engine is up and about to listen: a refused start stays one line on stderr.
    warn_if_open("token-engine", host, keys, log)
    app = build_app(engine, config.model_name, config.model, enable_prompt_tokens_details, logprobs_format,
                    log_requests=log_requests, scheduling_policy=scheduling_policy, api_keys=keys,
                    rl_control=rl_control, tokens_only=tokens_only, parser_flags=parser_flags)
    # What was built lives as long as the process: keep it out of the garbage collector's full passes, which
    # otherwise walk torch's objects in the middle of a step, a pause every decoding stream sees as a slow token.
    gc.freeze()
    # Draining also waits for KV blocks held for a decode peer (P/D prefill), so its pull still succeeds.
    lifecycle = Lifecycle(shutdown_grace_seconds, busy=lambda: bool(engine.engine.scheduler.held_by_connector))
    _stop_compiles_when_draining(lifecycle, engine.engine.grammars)
    server = DrainingServer(uvicorn.Config(wrap_app(app, lifecycle, access_log=access_log,
                                                    openapi=engine_openapi(VERSION)),
                                           host=host, port=port, log_level=log_level,
                                           access_log=False, log_config=None, timeout_graceful_shutdown=2,
                                           **connection_settings),
                            lifecycle)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound once the engine is up: a port in use is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port)") from None
    sock.listen(2048)
    return sock


def _stop_compiles_when_draining(lifecycle, grammars) -> None:
    """A grammar compile is not admitted work yet: on SIGTERM it ends at once with a 503 (another replica
    can take the request) instead of holding the drain for up to its time limit."""
    start_draining = lifecycle.start_draining

    def drain() -> None:  # runs in the signal handler: the close, which takes locks, on a thread of its own
        start_draining()
        threading.Thread(target=grammars.close, name="structured-close", daemon=True).start()

    lifecycle.start_draining = drain


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:  # its options (--help included) belong to the preflight parser
        from token_engine.kv_tools.preflight import main as preflight_main

        return preflight_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "make-random-model":
        from token_engine.models.random_model import write_random_model

        path = write_random_model(args.out, arch=args.arch, preset=args.preset, overrides=args.overrides,
                                  tokenizer_dir=args.tokenizer, seed=args.seed, dtype=args.dtype)
        print(path)
        return 0
    if args.command == "with-random-weights":
        from token_engine.models.bundle_weights import with_random_weights

        print(with_random_weights(args.bundle, seed=args.seed))
        return 0
    from splitserve_common.auth import api_keys_from
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    # Everything that can be wrong with the command line or the model is one line on stderr, exit 2.
    try:
        error = vllm_flag_errors(args) or vllm_serve_flags.check_vllm_flags(args, "engine", log)
        if error:
            raise ValueError(error)
        vllm_flags.apply_hub_flags(args)
        vllm_flags.uvicorn_tls_settings(args)
        check_kv_transfer_config(args)
        resolve_model_args(args)
        check_model_dir(args)
        vllm_flags.log_noop_flags(args, NOOP_FLAGS, log)
        if args.enable_chunked_prefill is False:
            log.info("--no-enable-chunked-prefill: accepted; prefill is always chunked under "
                     "--max-num-batched-tokens (outputs are the same)")
        config = engine_config_from_args(args)
        uvicorn_connection_settings(args.http_header_timeout)  # a bad timeout is one line here, not a traceback
    except (ValueError, OSError) as exc:
        print(f"token-engine: {exc}", file=sys.stderr)
        return 2
    try:
        serve(config, args.host, args.port, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
              logprobs_format=args.generate_logprobs_format, log_level=vllm_flags.uvicorn_log_level(args),
              shutdown_grace_seconds=args.shutdown_grace_seconds, access_log=not args.disable_uvicorn_access_log,
              log_requests=args.enable_log_requests, scheduling_policy=args.scheduling_policy,
              api_keys=api_keys_from(args.api_key), header_timeout_s=args.http_header_timeout,
              tls=vllm_flags.uvicorn_tls_settings(args), rl_control=args.enable_rl_control,
              tokens_only=args.tokens_only or args.skip_tokenizer_init, parser_flags=parser_flags_from_args(args))
    except (ValueError, OSError) as exc:  # the engine could not start (side-channel port in use, KV too small)
        print(f"token-engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
