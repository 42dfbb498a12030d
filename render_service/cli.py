"""``render-service serve [MODEL_DIR]``: the render server, with vLLM's flag names.

``--workers N`` pre-forks: the parent loads the bundle and builds the app once, binds the socket,
then forks N processes that serve on that one socket (the kernel spreads connections). A worker
therefore starts in milliseconds, not in the seconds a tokenizer load takes, and one that dies is
replaced from the already-loaded parent. Threads would not help: the GIL caps them at one core.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from render_service.multimodal.setup import multimodal_render_for
from render_service.render.reference_mode import REFERENCE_ENV, reference_render, set_reference_render
from render_service.tokenize.fastokens_path import BACKEND_ENV, BACKENDS
from splitserve_common import vllm_flags, vllm_serve_flags
from splitserve_common.auth import add_api_key_argument
from splitserve_common.block_hashes import HASH_ALGOS, BlockHashConfig
from splitserve_common.cli_args import json_object_arg
from splitserve_common.connection_timeouts import add_header_timeout_argument

logger = logging.getLogger("render_service.cli")
NOOP_FLAGS = (vllm_flags.TRUST_REMOTE_CODE,)
ENGINE_API_KEY_ENV = "SPLITSERVE_ENGINE_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="render-service", description="splitserve render tier")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve /render, /derender, /tokenize, ... for one model bundle")
    serve.add_argument("model", nargs="?", default=None,
                       help="Hugging Face model directory (default: the built-in default bundle)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients may send; the first is used in responses")
    serve.add_argument("--chat-template", default=None, help="chat template file, or the template text itself")
    serve.add_argument("--default-chat-template-kwargs", type=json_object_arg, default=None,
                       help='JSON object of chat template kwargs, e.g. \'{"enable_thinking": false}\'')
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template field in requests")
    serve.add_argument("--chat-template-timeout", type=float, default=None, metavar="SECONDS",
                       help="CPU time one chat-template render may take before it is refused with a 400 "
                            "(default 5)")
    serve.add_argument("--reasoning-parser", default=None)
    serve.add_argument("--tool-call-parser", default=None)
    serve.add_argument("--enable-auto-tool-choice", action="store_true")
    serve.add_argument("--tool-strict-level", default="auto", choices=["auto", "function", "parameter"],
                       help="vLLM's floor for constraining tool calls (hermes): auto = forced calls' syntax, "
                            "arguments only for strict tools; function = every request with tools; parameter "
                            "= also every tool's arguments, as if each were strict")
    serve.add_argument("--reasoning-field", default="reasoning", choices=["reasoning", "reasoning_content", "both"],
                       help="chat key(s) for reasoning text: 'reasoning' (vLLM >= 0.11), the older "
                            "'reasoning_content', or both; batch, streaming derender and the gateway alike")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens as vLLM's 'token_id:N' strings unless a request says otherwise "
                            "(default: decoded text plus integer token_id)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256",
                       help="the engines' prefix-caching hash (vLLM's flag): the block hashes a render request "
                            "asks for with return_block_hashes are computed with it and --block-size")
    serve.add_argument("--render-cache-bytes", type=int, default=None, metavar="BYTES",
                       help="per worker process: chat messages and tools decoded before, by their JSON (an "
                            "eighth), recent request bodies (an eighth), and of the rest, token ids of prompt "
                            "pieces seen before (agents resend their conversation every turn; three quarters) "
                            "and of recent prompts, found again by their head (a quarter), least recently used "
                            "dropped first; 0 disables (default 256 MiB)")
    serve.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                       help="per worker process: renders allowed to wait for a render thread; more are answered "
                            "429 with Retry-After (default: no bound)")
    serve.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                       help="image URLs are fetched only from these hosts (and their subdomains), never from "
                            "loopback, private or link-local addresses; data: URLs always work (default: none)")
    serve.add_argument("--image-workers", type=int, default=None, metavar="N",
                       help="per server process: worker processes that decode and preprocess images, for a "
                            "covered vision-language model (default: cores, at most 8)")
    serve.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                       help='vLLM\'s flag: images one request may carry, e.g. \'{"image": 8}\' (default 32)')
    serve.add_argument("--max-image-bytes", type=int, default=None, metavar="N",
                       help="an image's encoded size, checked before decoding (default 20 MiB)")
    serve.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                       help="width x height an image's header may declare (default 6144 x 6144)")
    serve.add_argument("--max-request-image-pixels", type=int, default=None, metavar="N",
                       help="declared pixels of all images of one request (default 8 x 4096 x 4096)")
    serve.add_argument("--mm-device-do-normalize", action=argparse.BooleanOptionalAction, default=True,
                       help="vLLM's flag, its default on: pixel values go out as raw uint8 and the engine "
                            "normalises them on its device; --no-mm-device-do-normalize sends float32 normalised "
                            "values, for an engine started with that flag off")
    serve.add_argument("--image-queue", type=int, default=None, metavar="N",
                       help="per server process: images waiting for a worker; more are answered 429 with "
                            "Retry-After (default 256)")
    add_api_key_argument(serve, "/health, /version, /metrics")
    add_header_timeout_argument(serve)
    serve.add_argument("--stream-state-secret", default=os.environ.get("SPLITSERVE_STREAM_STATE_SECRET"),
                       help="key that signs stream_state (env SPLITSERVE_STREAM_STATE_SECRET); "
                            "every replica of a tier needs the same one")
    serve.add_argument("--workers", "--api-server-count", type=int, default=None,
                       help="server processes sharing the port (default 1; vLLM's --api-server-count)")
    serve.add_argument("--renderer-num-workers", type=int, default=None, metavar="N",
                       help="vLLM's render thread pool size: here N server processes, unless --workers is given")
    serve.add_argument("--tokenizer", default=None,
                       help="directory or model id of the tokenizer and chat template (default: the model's)")
    serve.add_argument("--revision", default=None, help="model revision (branch, tag or commit) for a model id")
    serve.add_argument("--reference-render", action="store_true", default=reference_render(),
                       help="every render acceleration off (render caches, tojson cache, fast tokenizer paths, "
                            f"direct HTTP): the plain path, to compare against (default: ${REFERENCE_ENV})")
    serve.add_argument("--tokenizer-backend", default=os.environ.get(BACKEND_ENV, "auto"), choices=list(BACKENDS),
                       help="encode path: auto (fastokens where it equals tokenizers on the self-check, else "
                            "tiktoken where provably equal, else tokenizers), tiktoken (skip fastokens: ~0.8 s "
                            "and tens of MB less per worker), tokenizers (env SPLITSERVE_TOKENIZER_BACKEND)")
    vllm_flags.add_uvicorn_log_level(serve)
    vllm_flags.add_noop_flags(serve, NOOP_FLAGS)
    gw = serve.add_argument_group("gateway", "serve /v1/chat/completions and /v1/completions over engine pools")
    gw.add_argument("--engine", action="extend", nargs="+", default=None, metavar="URL",
                    help="collocated engine replica(s); a host with several addresses is one replica per address")
    gw.add_argument("--prefill", action="extend", nargs="+", default=None, metavar="URL",
                    help="prefill engine replica(s) (disaggregated, with --decode)")
    gw.add_argument("--decode", action="extend", nargs="+", default=None, metavar="URL",
                    help="decode engine replica(s) (disaggregated, with --prefill)")
    gw.add_argument("--engine-api-key", default=os.environ.get(ENGINE_API_KEY_ENV), metavar="KEY",
                    help="sent as 'Authorization: Bearer KEY' on every engine call: the engines' --api-key "
                         f"(default: ${ENGINE_API_KEY_ENV})")
    gw.add_argument("--engine-block-size", "--block-size", type=int, default=16,
                    help="the engines' KV block size (prefix affinity, and the block hashes render hands out)")
    gw.add_argument("--engine-max-num-seqs", type=int, default=256, metavar="N",
                    help="the engines' --max-num-seqs: P/D refuses n above it (400), as a collocated engine does")
    gw.add_argument("--prefix-affinity-blocks", type=int, default=4,
                    help="leading KV blocks of the prompt that key replica affinity (0: load only)")
    gw.add_argument("--prefix-affinity-load-factor", type=float, default=1.25,
                    help="affinity yields once a replica carries this times the mean load")
    gw.add_argument("--engine-retries", type=int, default=2,
                    help="further replicas to try when one fails before the first token")
    gw.add_argument("--dns-refresh-interval", type=float, default=10.0, help="seconds between re-resolving pools")
    gw.add_argument("--conversation-kv-blocks-ttl", type=float, default=450.0, metavar="SECONDS",
                    help="P/D with bidirectional_kv_xfer: how long decode's end-of-turn KV params are kept per "
                         "conversation_id for the next turn's prefill; keep it below the engines' "
                         "decoder_kv_blocks_ttl (480 s by default). 0 disables reuse")
    gw.add_argument("--max-conversations", type=int, default=10000,
                    help="conversations whose held KV params the gateway keeps (least recent dropped first)")
    gw.add_argument("--pd-transfer-mode", default="pull", choices=["pull", "push"],
                    help="P/D: pull (prefill, then decode READs its KV) or push (engines run NixlPushConnector: "
                         "both legs at once, prefill WRITEs into the blocks decode reserved)")
    gw.add_argument("--pd-min-uncached-tokens", type=int, default=0, metavar="N",
                    help="P/D: send a request to decode alone when fewer than N of its prompt tokens are uncached "
                         "there (estimated from the prompts routed to that replica); 0 always disaggregates")
    gw.add_argument("--responses-store-path", default=None, metavar="FILE",
                    help="SQLite file of stored Responses (store / previous_response_id); default: "
                         "responses.sqlite3 in the local cache directory")
    gw.add_argument("--responses-store-dsn", default=os.environ.get("SPLITSERVE_RESPONSES_STORE_DSN"), metavar="DSN",
                    help="PostgreSQL DSN (postgresql://user:pass@host/db) for stored Responses shared by several "
                         "gateway replicas, instead of SQLite (default: $SPLITSERVE_RESPONSES_STORE_DSN)")
    gw.add_argument("--responses-store-max-entries", type=int, default=100_000,
                    help="stored Responses kept at most (the oldest go first)")
    gw.add_argument("--responses-store-ttl", type=float, default=30 * 24 * 3600.0, metavar="SECONDS",
                    help="stored Responses older than this are dropped (default 30 days)")
    gw.add_argument("--responses-store-max-bytes", type=int, default=1 << 30, metavar="BYTES",
                    help="stored Responses of all tenants together, at most (the oldest go first; default 1 GiB)")
    gw.add_argument("--responses-store-tenant-bytes", type=int, default=64 << 20, metavar="BYTES",
                    help="stored Responses of one tenant together, at most, and so of one response (the tenant's "
                         "oldest go first; default 64 MiB)")
    gw.add_argument("--tenant-header", default=None, metavar="NAME",
                    help="a header by which an authenticated proxy in front names its client: callers with a valid "
                         "--api-key and this header are told apart by its value (default: by their key)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default="text", choices=["json", "text"],
                       help="json: one object per line (ts, level, logger, msg, request_id, fields)")
    serve.add_argument("--shutdown-grace-seconds", "--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, how long in-flight requests may take before the process exits")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true", help="(accepted for vLLM parity)")
    vllm_flags.add_tls_and_hub_flags(serve)
    vllm_serve_flags.add_vllm_flags(serve)
    return parser


def resolve_model_dir(model: str | None, revision: str | None = None) -> tuple[str, str]:
    """(directory, default served name). vLLM names a model by the argument exactly as given; a model id is
    found in the Hugging Face cache, else downloaded (tokenizer and configs only)."""
    if model is not None:
        from splitserve_common.hf_cache import resolve_model

        return resolve_model(model, revision, weights=False).directory, model
    from render_service.bundle.default_bundle import default_bundle_dir

    directory = default_bundle_dir()
    # The cache directory ends in a content hash ("qwen3-tiny-282fb4622aa470de"); serve it as "qwen3-tiny".
    return str(directory), re.sub(r"-[0-9a-f]{8,}$", "", Path(directory).name)


def build_gateway(args: argparse.Namespace) -> Any:
    """The gateway when engine pools were given, else None (ValueError on a bad combination)."""
    if not (args.engine or args.prefill or args.decode):
        return None
    from render_service.gateway.engine_client import EngineClient
    from render_service.gateway.flow import Gateway, GatewaySettings

    settings = GatewaySettings(
        block_size=args.engine_block_size, affinity_blocks=args.prefix_affinity_blocks,
        retries=args.engine_retries, load_factor=args.prefix_affinity_load_factor,
        dns_refresh_s=args.dns_refresh_interval, conversation_ttl_s=args.conversation_kv_blocks_ttl,
        max_conversations=args.max_conversations, pd_transfer_mode=args.pd_transfer_mode,
        pd_min_uncached_tokens=args.pd_min_uncached_tokens, max_num_seqs=args.engine_max_num_seqs,
        responses_store_path=args.responses_store_path, responses_store_dsn=args.responses_store_dsn,
        responses_store_max_entries=args.responses_store_max_entries, responses_store_ttl_s=args.responses_store_ttl,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_tenant_bytes=args.responses_store_tenant_bytes, tenant_header=args.tenant_header,
    )
    return Gateway(engines=args.engine, prefill=args.prefill, decode=args.decode, settings=settings,
                   client=EngineClient(api_key=args.engine_api_key))


def _uvicorn_server(app: Any, args: argparse.Namespace) -> Any:
    """uvicorn that drains on SIGTERM (see splitserve_common.lifecycle); one Lifecycle per process."""
    import uvicorn

    from render_service.gateway.latency import GatewayLatency
    from render_service.http.openapi import render_openapi
    from render_service.http.request_io import version
    from render_service.http.server import warm_render_lanes
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.lifecycle import DrainingServer, Lifecycle, wrap_app

    lifecycle = Lifecycle(args.shutdown_grace_seconds)
    render_app = app
    warm_render_lanes(render_app)
    gateway = bool(args.engine or args.prefill or args.decode)
    openapi = render_openapi(version(), gateway=gateway)
    app = wrap_app(app, lifecycle, access_log=not args.disable_uvicorn_access_log, openapi=openapi,
                   timing=GatewayLatency() if gateway else None)
    settings = uvicorn_connection_settings(args.http_header_timeout) | vllm_flags.uvicorn_tls_settings(args)
    settings["http"] = _with_direct_routes(settings["http"], render_app, lifecycle,
                                           access_log=not args.disable_uvicorn_access_log)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=vllm_flags.uvicorn_log_level(args), access_log=False,
        log_config=None, loop="auto", lifespan="off", timeout_graceful_shutdown=2, **settings,
    )
    return DrainingServer(config, lifecycle)


DIRECT_HTTP_ENV = "SPLITSERVE_DIRECT_HTTP"  # "0": every request through ASGI (an A/B, or a suspected fault)


def _with_direct_routes(protocol: type, app: Any, lifecycle: Any, *, access_log: bool) -> type:
    """The HTTP protocol answering the render endpoints without the ASGI round trip (http/direct_http.py), where it
    is uvicorn's httptools one (h11's keeps the usual path)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from render_service.http.direct_http import direct_protocol, protocol_violation
    from render_service.http.server import RawRequest, direct_routes

    if not issubclass(protocol, HttpToolsProtocol) or os.environ.get(DIRECT_HTTP_ENV, "1") == "0" \
            or reference_render():
        return protocol
    violation = protocol_violation(protocol)
    if violation is not None:  # uvicorn's internals moved: every request through ASGI
        logger.warning("the direct HTTP path is off: %s", violation)
        return protocol
    return direct_protocol(protocol, direct_routes(app), app, RawRequest, lifecycle, access_log)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def image_bounds(args: argparse.Namespace) -> Any:
    """The image bounds the flags ask for (multimodal.bounds.ImageBounds); a bad value ends startup."""
    from render_service.multimodal.bounds import ImageBounds

    given: dict[str, int] = {}
    if args.limit_mm_per_prompt:
        try:
            limits = json.loads(args.limit_mm_per_prompt)
            given["max_images"] = int(limits.get("image", ImageBounds.max_images))
        except (ValueError, TypeError, AttributeError):
            raise SystemExit(f"--limit-mm-per-prompt must be a JSON object like '{{\"image\": 8}}', "
                             f"got {args.limit_mm_per_prompt!r}") from None
    for flag, field in (("max_image_bytes", "max_image_bytes"), ("max_image_pixels", "max_image_pixels"),
                        ("max_request_image_pixels", "max_request_pixels")):
        if getattr(args, flag) is not None:
            given[field] = getattr(args, flag)
    if any(value < 1 for value in given.values()):
        raise SystemExit("image bounds must be positive")
    return ImageBounds(**given)


def serve(args: argparse.Namespace, heap: str | None = None) -> int:
    """``heap``: what the command line's start-over said of the heap's pages, where it did not start over."""
    from splitserve_common.auth import ApiKeys, api_keys_from, warn_if_open
    from splitserve_common.connection_timeouts import uvicorn_connection_settings
    from splitserve_common.logs import configure_logging
    from splitserve_common.malloc_arenas import heap_pages, limit_to_one_arena

    configure_logging(args.log_level, args.log_format)
    logger.debug("allocator: %s, %s", limit_to_one_arena(), heap or heap_pages())  # first: before any thread allocates
    if args.workers is None:  # vLLM's --renderer-num-workers maps onto our processes (threads would share a GIL)
        args.workers = args.renderer_num_workers or 1
        if args.renderer_num_workers:
            logger.info("--renderer-num-workers %d: serving with %d worker processes", args.workers, args.workers)
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    vllm_flags.log_noop_flags(args, NOOP_FLAGS, logger)
    refused = vllm_serve_flags.check_vllm_flags(args, "render", logger)
    if refused:
        print(f"render-service: {refused}", file=sys.stderr)
        return 2
    vllm_flags.apply_hub_flags(args)
    try:
        uvicorn_connection_settings(args.http_header_timeout)
        vllm_flags.uvicorn_tls_settings(args)
    except ValueError as exc:
        print(f"render-service: {exc}", file=sys.stderr)
        return 2
    api_keys = api_keys_from(args.api_key)
    metrics_dir = None
    if args.workers > 1:
        # Must be set before prometheus_client is imported (render_service.http.server imports it).
        metrics_dir = tempfile.mkdtemp(prefix="render-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    # Forked workers must not inherit a Rust thread pool mid-use.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ[BACKEND_ENV] = args.tokenizer_backend  # read where the tokenizer is loaded (fastokens_path)
    set_reference_render(args.reference_render)  # read where each acceleration is built (render/reference_mode.py)
    try:
        started = time.perf_counter()
        from render_service.http.server import create_app
        from render_service.render.render_config import load_render_config
        from render_service.tokenize.ids_json import BACKEND as ids_json_backend

        model_dir, default_name = resolve_model_dir(args.model, args.revision)
        tokenizer_dir = resolve_model_dir(args.tokenizer)[0] if args.tokenizer else None
        config = load_render_config(
            model_dir,
            tokenizer_dir=tokenizer_dir,
            served_model_names=args.served_model_name or [default_name],
            chat_template=args.chat_template,
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            trust_request_chat_template=args.trust_request_chat_template,
            max_model_len=args.max_model_len,
            reasoning_field=args.reasoning_field,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            render_cache_bytes=args.render_cache_bytes,
            tool_strict_level=args.tool_strict_level,
            block_hash_config=block_hash_config(args),
            **({} if args.chat_template_timeout is None else {"chat_template_timeout_s": args.chat_template_timeout}),
        )
        gateway = build_gateway(args)
        if gateway is not None and args.tenant_header and not api_keys:
            raise ValueError("--tenant-header needs --api-key: a tenant header is believed only from a caller "
                             "that authenticated")
        multimodal = multimodal_render_for(config, model_id=args.model, workers=args.image_workers,
                                           allowed_domains=tuple(args.allowed_media_domains),
                                           bounds=image_bounds(args), max_pending=args.image_queue or 256,
                                           device_normalize=args.mm_device_do_normalize)
        app = create_app(config, api_key=api_keys, stream_state_secret=args.stream_state_secret,
                         gateway=gateway, max_queued_requests=args.max_queued_requests, multimodal=multimodal)
        logger.info("loaded %s in %.2fs (fingerprint %s, max_model_len %d; encode: %s; prompt cache: %s; "
                    "ids as JSON: %s; message memo: %s)",
                    model_dir, time.perf_counter() - started, config.fingerprint, config.max_model_len,
                    getattr(config.tokenizer, "encode_backend_reason", "the bundle's own"),
                    config.prompt_encoder.reason if config.prompt_encoder is not None else "none",
                    ids_json_backend,
                    f"{config.message_memo.max_bytes} bytes" if config.message_memo is not None else "off")
        # What was loaded lives as long as the process: keep it out of the garbage collector's full passes
        # (the vocabulary alone made each one cost ~15 ms, paid by whichever request triggered it), and
        # out of copy-on-write faults in forked workers.
        gc.freeze()
        # Warned once the server is about to listen: a refused command line stays one line on stderr.
        warn_if_open("the gateway" if gateway is not None else "render-service", args.host, ApiKeys(api_keys),
                     logger)
        if not app.state.server.stream_runtime.shared_secret:
            logger.warning("stream_state is signed with a secret drawn for this server alone: another replica "
                           "cannot continue its streams (a 400). Give every replica the same "
                           "--stream-state-secret (or SPLITSERVE_STREAM_STATE_SECRET)")
        if args.workers == 1:
            _uvicorn_server(app, args).run()
            return 0
        return _prefork(app, args)
    except (ValueError, OSError) as exc:
        print(f"render-service: {exc}", file=sys.stderr)
        return 1
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _prefork(app: Any, args: argparse.Namespace) -> int:
    sock = _bind(args.host, args.port)
    children: dict[int, tuple[int, float]] = {}  # pid -> (worker number, start time)
    stopping = False

    def spawn(number: int) -> None:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                _uvicorn_server(app, args).run(sockets=[sock])
            finally:
                os._exit(0)
        children[pid] = (number, time.monotonic())

    def stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for number in range(args.workers):
        spawn(number)
    logger.info("serving on %s:%d with %d worker processes", args.host, args.port, args.workers)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        child = children.pop(pid, None)
        if child is not None and not stopping:
            number, started = child
            logger.warning("worker %d (pid %d) exited with status %d; starting a new one", number, pid, status)
            if time.monotonic() - started < 1.0:
                time.sleep(1.0)  # a worker that dies at once must not become a fork loop
            if not stopping:  # a SIGTERM during the pause must not leave a fresh worker nobody stops
                spawn(number)
    sock.close()
    return 0


def block_hash_config(args: argparse.Namespace) -> BlockHashConfig:
    """The block hashes render hands out: the engines' block size and hash (vLLM: $PYTHONHASHSEED seeds both)."""
    try:
        return BlockHashConfig(block_size=args.engine_block_size, hash_algo=args.prefix_caching_hash_algo)
    except ValueError as exc:
        raise SystemExit(f"render-service: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        heap = None
        if argv is None:  # the command line's own process: start over with the heap on huge pages, where it may
            from splitserve_common.malloc_arenas import restart_with_heap_on_huge_pages

            heap = restart_with_heap_on_huge_pages()  # (returns only where it did not start over: why, for the log)
        return serve(args, heap)
    return 2


if __name__ == "__main__":
    sys.exit(main())

