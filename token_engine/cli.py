"""`token-engine serve MODEL_DIR` (vLLM's flag names) and `token-engine make-random-model OUT`."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from splitserve_common.auth import add_api_key_argument
from splitserve_common.cli_args import json_object_arg
from splitserve_common.connection_timeouts import add_header_timeout_argument
from token_engine.engine import EngineConfig


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
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None,
                   help="number of KV blocks (CPU or GPU), overriding the memory-based sizing")
    s.add_argument("--kv-cache-memory-bytes", type=_positive_int, default=None,
                   help="KV cache size in bytes (CPU default: enough for 8 full-length sequences, at most 4 GiB)")
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps without CUDA graphs")
    s.add_argument("--max-logprobs", type=int, default=20)
    s.add_argument("--enable-prompt-tokens-details", action="store_true")
    s.add_argument("--generate-logprobs-format", choices=["ids", "token_id_strings"], default="ids",
                   help="logprobs shape on /inference/v1/generate: integer ids (newer vLLM) or 'token_id:N' strings")
    s.add_argument("--kv-transfer-config", type=json_object_arg, default=None,
                   help='KV connector config as JSON, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'')
    s.add_argument("--kv-side-channel-secret", default=None,
                   help="shared secret of the NIXL side channel's HMAC handshake, the same on every engine "
                        "(default: $SPLITSERVE_KV_SECRET; prefer the variable: flags show in ps)")
    s.add_argument("--kv-allowed-peers", default=None,
                   help="comma-separated hosts/CIDRs this engine may fetch KV from (default: "
                        "$SPLITSERVE_KV_ALLOWED_PEERS, else loopback only), e.g. 127.0.0.1/32,10.0.0.0/8")
    s.add_argument("--tokens-only", action="store_true", help="accepted for vLLM compatibility; always on")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-format", default="text", choices=["json", "text"],
                   help="json: one object per line (ts, level, logger, msg, request_id, fields)")
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests and held KV leases may take before exit")

    pf = sub.add_parser("preflight", add_help=False,
                        help="check the KV transfer path (NIXL/UCX) between two local agents; --help for options")
    pf.add_argument("preflight_args", nargs=argparse.REMAINDER)

    r = sub.add_parser("make-random-model", help="write a random-weight model directory (no hub access)")
    r.add_argument("out")
    r.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "mistral"], default="qwen3")
    r.add_argument("--preset", default="tiny", help="tiny, qwen2.5-7b, ... (see token_engine.random_model.PRESETS)")
    r.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied in")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--overrides", type=json_object_arg, default=None, help="config.json keys to override, as JSON")

    w = sub.add_parser("with-random-weights",
                       help="print a cached copy of a weightless bundle (tokenizer + config) with random weights")
    w.add_argument("bundle", help="model directory with config.json (e.g. the render tier's default bundle)")
    w.add_argument("--seed", type=int, default=0)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if args.kv_transfer_config and args.kv_transfer_config.get("kv_connector") == "NixlConnector":
        from token_engine.kv_connector.config import parse_nixl_config

        extra = dict(args.kv_transfer_config.get("kv_connector_extra_config") or {})
        for key, value in (("kv_side_channel_secret", args.kv_side_channel_secret),
                           ("kv_allowed_peers", args.kv_allowed_peers)):
            if value is not None:
                extra[key] = value
        if extra:
            args.kv_transfer_config = {**args.kv_transfer_config, "kv_connector_extra_config": extra}
        parse_nixl_config(args.kv_transfer_config)  # a bad key is a one-line error here, not a traceback later
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
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        max_logprobs=args.max_logprobs,
        kv_transfer_config=args.kv_transfer_config,
    )


def serve(config: EngineConfig, host: str, port: int, *, sock: socket.socket | None = None,
          enable_prompt_tokens_details: bool = False, logprobs_format: str = "ids", log_level: str = "info",
          shutdown_grace_seconds: float = 30.0, api_keys: list[str] | None = None,
          header_timeout_s: float = 10.0) -> None:
    import uvicorn

    from splitserve_common.auth import ApiKeys, warn_if_open
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.lifecycle import DrainingServer, Lifecycle, wrap_app
    from token_engine.engine import AsyncEngine, LLMEngine
    from token_engine.openapi import engine_openapi
    from token_engine.server import VERSION, build_app

    keys = ApiKeys(api_keys)
    connection_settings = uvicorn_connection_settings(header_timeout_s)
    warn_if_open("token-engine", host, keys, logging.getLogger("token_engine.cli"))
    engine = AsyncEngine(LLMEngine(config))
    engine.start()
    app = build_app(engine, config.model_name, config.model, enable_prompt_tokens_details, logprobs_format,
                    api_keys=keys)
    # Draining also waits for KV blocks held for a decode peer (P/D prefill), so its pull still succeeds.
    lifecycle = Lifecycle(shutdown_grace_seconds, busy=lambda: bool(engine.engine.scheduler.held_by_connector))
    server = DrainingServer(uvicorn.Config(wrap_app(app, lifecycle, openapi=engine_openapi(VERSION)), host=host, port=port, log_level=log_level,
                                           access_log=False, log_config=None, timeout_graceful_shutdown=2,
                                           **connection_settings),
                            lifecycle)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:  # its options (--help included) belong to the preflight parser
        from token_engine.kv_connector.preflight import main as preflight_main

        return preflight_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "make-random-model":
        from token_engine.random_model import write_random_model

        path = write_random_model(args.out, arch=args.arch, preset=args.preset, overrides=args.overrides,
                                  tokenizer_dir=args.tokenizer, seed=args.seed, dtype=args.dtype)
        print(path)
        return 0
    if args.command == "with-random-weights":
        from token_engine.bundle_weights import with_random_weights

        print(with_random_weights(args.bundle, seed=args.seed))
        return 0
    from splitserve_common.auth import api_keys_from
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    try:
        config = engine_config_from_args(args)
        uvicorn_connection_settings(args.http_header_timeout)  # a bad timeout is one line here, not a traceback
    except ValueError as exc:
        print(f"token-engine: {exc}", file=sys.stderr)
        return 2
    serve(config, args.host, args.port, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
          logprobs_format=args.generate_logprobs_format, log_level=args.log_level,
          shutdown_grace_seconds=args.shutdown_grace_seconds, api_keys=api_keys_from(args.api_key),
          header_timeout_s=args.http_header_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
