"""Every flag of vLLM 0.34's ``vllm serve`` (and ``vllm launch render``, which takes the same parser), and what
each of our servers does with it: ours (the server's own parser defines it: mapped), accepted with a note in the
startup log (it changes nothing here), or refused at startup with one line naming the alternative.

The flag names and which take a value are vLLM 0.34.0's own (its ``make_arg_parser``, dumped from the wheel);
``--model`` is left out (both servers take the model as their positional argument). A flag vLLM adds later is a
test failure until it is classified here (tests/test_vllm_flag_walk.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Tier = Literal["engine", "render"]

# vLLM 0.34.0's flags that take a value, and its switches (store_true/false, --x/--no-x pairs).
VALUED = (
    "--additional-config", "--all2all-backend", "--allowed-headers", "--allowed-local-media-path",
    "--allowed-media-domains", "--allowed-methods", "--allowed-origins", "--anthropic-disabled-thinking-effort",
    "--api-key", "--api-server-count", "--attention-backend", "--attention-config", "--aux-output-config",
    "--block-size", "--cache-aware-admission-threshold", "--cache-aware-admission-window", "--chat-template",
    "--chat-template-content-format", "--code-revision", "--cohere-format", "--collect-detailed-traces",
    "--compilation-config", "--config", "--config-format", "--convert", "--cp-kv-cache-interleave-size",
    "--cpu-distributed-timeout-seconds", "--cpu-offload-gb", "--cpu-offload-params", "--cudagraph-capture-sizes",
    "--custom-histogram-buckets", "--data-parallel-address", "--data-parallel-backend", "--data-parallel-rank",
    "--data-parallel-rpc-port", "--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
    "--data-parallel-supervisor-port", "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold",
    "--dcp-comm-backend", "--dcp-kv-cache-interleave-size", "--decode-context-parallel-size",
    "--default-chat-template-kwargs", "--default-mm-loras", "--device-ids", "--device-memory-utilization",
    "--diffusion-config", "--disable-access-log-for-endpoints", "--distributed-executor-backend",
    "--distributed-timeout-seconds", "--download-dir", "--dp-supervisor-probe-failure-threshold",
    "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s", "--dp-sync-interval", "--dtype",
    "--ec-manager-config", "--ec-transfer-config", "--elastic-ep-max-dp-size", "--engram-config", "--eplb-config",
    "--expert-placement-strategy", "--fault-tolerance-config", "--fingerprint-mode", "--fingerprint-value",
    "--gdn-prefill-backend", "--generation-config", "--gpu-memory-utilization", "--grpc-port",
    "--h11-max-header-count", "--h11-max-incomplete-event-size", "--headless-client-handshake-address",
    "--hf-config-path", "--hf-overrides", "--hf-token", "--host", "--ignore-patterns", "--io-processor-plugin",
    "--ir-op-priority", "--jit-monitor-mode", "--kda-decode-backend", "--kda-prefill-backend", "--kernel-config",
    "--kv-cache-dtype", "--kv-cache-dtype-skip-layers", "--kv-cache-memory-bytes", "--kv-cache-metrics-sample",
    "--kv-events-config", "--kv-offloading-backend", "--kv-offloading-size", "--kv-transfer-config",
    "--limit-mm-per-prompt", "--linear-backend", "--load-format", "--log-config-file", "--log-level",
    "--logging-config", "--logits-processors", "--logprobs-mode", "--long-prefill-token-threshold", "--lora-dtype",
    "--lora-modules", "--lora-target-modules", "--mamba-backend", "--mamba-block-size", "--mamba-cache-dtype",
    "--mamba-cache-mode", "--mamba-cache-philox-rounds", "--mamba-ssm-cache-dtype", "--mamba-ssu-algorithm",
    "--master-addr", "--master-port", "--max-cpu-loras", "--max-cudagraph-capture-size", "--max-log-len",
    "--max-logprobs", "--max-lora-cls-labels", "--max-lora-rank", "--max-loras", "--max-model-len",
    "--max-num-active-seqs", "--max-num-batched-tokens", "--max-num-inflight-kv-loads", "--max-num-queued-reqs",
    "--max-num-queued-tokens", "--max-num-scheduled-tokens", "--max-num-seqs", "--max-parallel-loading-workers",
    "--media-io-kwargs", "--middleware", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
    "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path",
    "--mm-encoder-tp-mode", "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb", "--mm-processor-cache-gb",
    "--mm-processor-cache-type", "--mm-processor-device", "--mm-processor-kwargs",
    "--mm-shm-cache-max-object-size-mb", "--mm-tensor-ipc", "--model-class-overrides", "--model-impl",
    "--model-loader-extra-config", "--moe-backend", "--nnodes", "--node-rank", "--num-gpu-blocks-override",
    "--numa-bind-cpus", "--numa-bind-nodes", "--offload-backend", "--offload-group-size", "--offload-num-in-group",
    "--offload-params", "--offload-prefetch-step", "--optimization-level", "--otlp-traces-endpoint",
    "--override-generation-config", "--per-request-spec-decode-metrics", "--performance-mode",
    "--pipeline-parallel-size", "--pooler-config", "--port", "--prefill-context-parallel-size",
    "--prefill-schedule-interval", "--prefix-cache-retention-interval", "--prefix-caching-hash-algo",
    "--prefix-match-unit", "--profiler-config", "--pt-load-map-location", "--quantization", "--quantization-config",
    "--reasoning-config", "--reasoning-effort-map", "--reasoning-parser", "--reasoning-parser-plugin",
    "--renderer-num-workers", "--replayssm-buffer-len", "--response-role", "--revision", "--root-path", "--runner",
    "--safetensors-load-strategy", "--safetensors-prefetch-block-size", "--safetensors-prefetch-num-threads",
    "--scheduler-cls", "--scheduling-policy", "--seed", "--served-model-name", "--show-hidden-metrics-for-version",
    "--shutdown-timeout", "--sleep-mode-backend", "--sleep-preserve-parameter-names",
    "--sparse-indexer-topk-backend", "--spec-method", "--spec-model", "--spec-tokens", "--speculative-config",
    "--sse-keep-alive-interval", "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-certfile", "--ssl-ciphers",
    "--ssl-keyfile", "--stream-interval", "--structured-outputs-config", "--tensor-parallel-size", "--tokenizer",
    "--tokenizer-mode", "--tokenizer-revision", "--tool-call-parser", "--tool-parser-plugin", "--tool-server",
    "--tool-strict-level", "--ubatch-size", "--uds", "--uvicorn-log-level", "--video-pruning-method",
    "--video-pruning-rate", "--watchdog-config", "--watermark", "--watermark-config", "--weight-transfer-config",
    "--worker-cls", "--worker-extension-cls",
)
SWITCHES = (
    "--aggregate-engine-logging", "--allow-credentials", "--allow-deprecated-quantization", "--async-scheduling",
    "--checkpoint-prepare-on-startup", "--cohere-is-reasoning-model", "--cudagraph-metrics",
    "--data-parallel-external-lb", "--data-parallel-hybrid-lb", "--data-parallel-multi-port-external-lb",
    "--dcp-q-replicate", "--disable-auto-tool-choice", "--disable-batch-sharded-sampling", "--disable-cascade-attn",
    "--disable-chunked-mm-input", "--disable-chunked-prefill", "--disable-cumem-allocator",
    "--disable-custom-all-reduce", "--disable-dbo", "--disable-elastic-ep", "--disable-ep-weight-filter",
    "--disable-eplb", "--disable-expert-parallel", "--disable-extensible-kv-cache", "--disable-fastapi-docs",
    "--disable-fault-tolerance", "--disable-flash-late-interaction", "--disable-flashinfer-autotune",
    "--disable-force-include-usage", "--disable-hc-sp", "--disable-hybrid-kv-cache-manager",
    "--disable-layerwise-nvtx-tracing", "--disable-log-deltas", "--disable-log-outputs", "--disable-log-requests",
    "--disable-log-stats", "--disable-logging-iteration-details", "--disable-lora",
    "--disable-mamba-cache-stochastic-rounding", "--disable-mamba-shared-prefix-checkpoint", "--disable-mfu-metrics",
    "--disable-mixed-moe-lora-format", "--disable-mm-embeds", "--disable-moe-shared-loras",
    "--disable-nccl-comm-suspend", "--disable-nccl-for-dp-synchronization", "--disable-offline-docs",
    "--disable-per-request-metrics", "--disable-prefix-caching", "--disable-prompt-embeds",
    "--disable-prompt-tokens-details", "--disable-request-id-headers", "--disable-return-routed-experts",
    "--disable-scale-out", "--disable-server-load-tracking", "--disable-shm-tensor-arena", "--disable-sleep-mode",
    "--disable-sliding-window", "--disable-ssl-refresh", "--disable-tokenizer-info-endpoint",
    "--disable-tower-connector-lora", "--disable-trace-replay", "--disable-uvicorn-access-log",
    "--enable-auto-tool-choice", "--enable-batch-sharded-sampling", "--enable-cascade-attn",
    "--enable-chunked-mm-input", "--enable-chunked-prefill", "--enable-cumem-allocator",
    "--enable-custom-all-reduce", "--enable-dbo", "--enable-elastic-ep", "--enable-ep-weight-filter",
    "--enable-eplb", "--enable-expert-parallel", "--enable-extensible-kv-cache", "--enable-fastapi-docs",
    "--enable-fault-tolerance", "--enable-flash-late-interaction", "--enable-flashinfer-autotune",
    "--enable-force-include-usage", "--enable-hc-sp", "--enable-hybrid-kv-cache-manager",
    "--enable-layerwise-nvtx-tracing", "--enable-log-deltas", "--enable-log-outputs", "--enable-log-requests",
    "--enable-logging-iteration-details", "--enable-lora", "--enable-mamba-cache-stochastic-rounding",
    "--enable-mamba-shared-prefix-checkpoint", "--enable-mfu-metrics", "--enable-mixed-moe-lora-format",
    "--enable-mm-embeds", "--enable-moe-shared-loras", "--enable-nccl-comm-suspend",
    "--enable-nccl-for-dp-synchronization", "--enable-offline-docs", "--enable-per-request-metrics",
    "--enable-prefix-caching", "--enable-prompt-embeds", "--enable-prompt-tokens-details",
    "--enable-request-id-headers", "--enable-return-routed-experts", "--enable-scale-out",
    "--enable-server-load-tracking", "--enable-shm-tensor-arena", "--enable-sleep-mode", "--enable-sliding-window",
    "--enable-ssl-refresh", "--enable-tokenizer-info-endpoint", "--enable-tower-connector-lora",
    "--enable-trace-replay", "--enable-uvicorn-access-log", "--enforce-eager",
    "--exclude-tools-when-tool-choice-none", "--fail-on-environ-validation", "--fully-sharded-loras", "--grpc",
    "--headless", "--interleave-mm-strings", "--jit-monitor-verbose", "--kv-cache-metrics",
    "--kv-sharing-fast-prefill", "--language-model-only", "--log-error-stack",
    "--long-prefill-token-threshold-adaptive", "--mm-device-do-normalize", "--mm-encoder-only", "--monokernel",
    "--no-allow-credentials", "--no-allow-deprecated-quantization", "--no-async-scheduling",
    "--no-checkpoint-prepare-on-startup", "--no-cohere-is-reasoning-model", "--no-cudagraph-metrics",
    "--no-data-parallel-external-lb", "--no-data-parallel-hybrid-lb", "--no-dcp-q-replicate", "--no-enforce-eager",
    "--no-exclude-tools-when-tool-choice-none", "--no-fail-on-environ-validation", "--no-fully-sharded-loras",
    "--no-interleave-mm-strings", "--no-jit-monitor-verbose", "--no-kv-cache-metrics",
    "--no-kv-sharing-fast-prefill", "--no-language-model-only", "--no-log-error-stack",
    "--no-long-prefill-token-threshold-adaptive", "--no-mm-device-do-normalize", "--no-mm-encoder-only",
    "--no-monokernel", "--no-numa-bind", "--no-ray-workers-use-nsight", "--no-return-sampling-mask",
    "--no-return-tokens-as-token-ids", "--no-scheduler-reserve-full-isl", "--no-shuffle-safetensors-files",
    "--no-skip-mm-profiling", "--no-skip-tokenizer-init", "--no-sleep-mode-offload-cudagraph",
    "--no-specialize-active-lora", "--no-swa-bounded-replay", "--no-tokens-only", "--no-trust-remote-code",
    "--no-trust-request-chat-template", "--no-trust-request-mm-kwargs", "--no-use-fp64-gumbel", "--no-use-replayssm",
    "--no-use-tqdm-on-load", "--numa-bind", "--ray-workers-use-nsight", "--return-sampling-mask",
    "--return-tokens-as-token-ids", "--scheduler-reserve-full-isl", "--shuffle-safetensors-files",
    "--skip-mm-profiling", "--skip-tokenizer-init", "--sleep-mode-offload-cudagraph", "--specialize-active-lora",
    "--swa-bounded-replay", "--tokens-only", "--trust-remote-code", "--trust-request-chat-template",
    "--trust-request-mm-kwargs", "--use-fp64-gumbel", "--use-replayssm", "--use-tqdm-on-load",
)


ONE_DEVICE = "one device per engine here: run several engine replicas behind the gateway instead"
NO_LORA = "LoRA adapters are not served: merge the adapter into the weights and serve that model"
NO_CORS = "CORS headers are not served: set them at the ingress or proxy in front of the servers"
PLUGIN = "plugins are code and are never loaded: use one of the built-in names"

# Refused on both tiers, with the reason (and the alternative).
REFUSED_BOTH: dict[str, str] = {
    "--allowed-origins": NO_CORS, "--allowed-methods": NO_CORS, "--allowed-headers": NO_CORS,
    "--allow-credentials": NO_CORS,
    "--uds": "the servers listen on TCP only: use --host and --port",
    "--middleware": "no Python middleware is loaded (an import path is code)",
    "--grpc": "gRPC is not served: the APIs are HTTP/JSON", "--grpc-port": "gRPC is not served: the APIs are HTTP/JSON",
    "--tool-server": "built-in tool servers are not run: tools are the client's",
    "--tool-parser-plugin": PLUGIN, "--reasoning-parser-plugin": PLUGIN, "--io-processor-plugin": PLUGIN,
    "--config": "a YAML file of flags is not read: pass the flags on the command line",
    "--log-config-file": "logging is configured by --log-level and --log-format",
    "--logging-config": "logging is configured by --log-level and --log-format",
    "--otlp-traces-endpoint": "no tracing exporter: use the JSON logs (request ids) and /metrics",
    "--enable-ssl-refresh": "certificates are read at startup: restart (or roll the pods) to load new ones",
    "--enable-lora": NO_LORA, "--lora-modules": NO_LORA, "--default-mm-loras": NO_LORA,
}

# Refused by the engine only.
REFUSED_ENGINE: dict[str, str] = {
    "--quantization": "quantized checkpoints are not loaded: serve bf16/fp16 weights (--dtype)",
    "--quantization-config": "quantized checkpoints are not loaded: serve bf16/fp16 weights (--dtype)",
    "--speculative-config": "speculative decoding is not implemented: the engine decodes one token per step",
    "--spec-method": "speculative decoding is not implemented: the engine decodes one token per step",
    "--spec-model": "speculative decoding is not implemented: the engine decodes one token per step",
    "--spec-tokens": "speculative decoding is not implemented: the engine decodes one token per step",
    "--max-loras": NO_LORA, "--max-lora-rank": NO_LORA, "--lora-dtype": NO_LORA, "--lora-target-modules": NO_LORA,
    "--max-cpu-loras": NO_LORA, "--fully-sharded-loras": NO_LORA, "--enable-moe-shared-loras": NO_LORA,
    "--enable-mixed-moe-lora-format": NO_LORA, "--specialize-active-lora": NO_LORA,
    "--enable-tower-connector-lora": NO_LORA, "--max-lora-cls-labels": NO_LORA,
    "--runner": "the engine generates; pooling and other runners are not served",
    "--convert": "the engine generates; pooling and other runners are not served",
    "--pooler-config": "the engine generates; pooling and other runners are not served",
    "--hf-overrides": "the model's config.json is read as it is: edit a copy of the model directory",
    "--model-class-overrides": "the engine's own model modules are used (Llama, Qwen2/3, Mistral)",
    "--logits-processors": "custom logits processors are code and are never loaded",
    "--enable-prompt-embeds": "prompt embeddings are not accepted: send token ids",
    "--cpu-offload-gb": "weights stay on the device: use a device that holds them",
    "--offload-backend": "weights stay on the device: use a device that holds them",
    "--offload-group-size": "weights stay on the device: use a device that holds them",
    "--offload-num-in-group": "weights stay on the device: use a device that holds them",
    "--offload-params": "weights stay on the device: use a device that holds them",
    "--offload-prefetch-step": "weights stay on the device: use a device that holds them",
    "--cpu-offload-params": "weights stay on the device: use a device that holds them",
    "--watermark": "output watermarking is not implemented",
    "--watermark-config": "output watermarking is not implemented",
    "--disable-sliding-window": "sliding-window models run with their window (turning it off changes outputs)",
    "--decode-context-parallel-size": ONE_DEVICE, "--prefill-context-parallel-size": ONE_DEVICE,
    "--enable-expert-parallel": ONE_DEVICE, "--enable-eplb": ONE_DEVICE, "--enable-elastic-ep": ONE_DEVICE,
    "--headless": ONE_DEVICE, "--data-parallel-address": ONE_DEVICE, "--data-parallel-rpc-port": ONE_DEVICE,
    "--data-parallel-backend": ONE_DEVICE, "--data-parallel-external-lb": ONE_DEVICE,
    "--data-parallel-hybrid-lb": ONE_DEVICE, "--data-parallel-multi-port-external-lb": ONE_DEVICE,
    "--data-parallel-start-rank": ONE_DEVICE, "--master-addr": ONE_DEVICE, "--master-port": ONE_DEVICE,
    "--device-ids": "one device per engine: pick it with CUDA_VISIBLE_DEVICES",
    "--enable-sleep-mode": "sleep mode is not implemented: the engine keeps its weights and KV resident",
    "--weight-transfer-config": "weight transfer is not configured by this flag here",
}

# Refused by the render tier only.
REFUSED_RENDER: dict[str, str] = {
    "--skip-tokenizer-init": "the render tier is the tokenizer: it always loads one",
    "--reasoning-effort-map": "reasoning effort is rendered by the chat template (chat_template_kwargs)",
    "--exclude-tools-when-tool-choice-none": "tools stay in the prompt whatever tool_choice says, as vLLM's default",
    "--enable-mm-embeds": "multimodal embeddings are not accepted",
}

# Accepted when given one of these values (vLLM's default or an equivalent), refused otherwise.
NEUTRAL_VALUES: dict[str, tuple[str, ...]] = {
    "--tokenizer-mode": ("auto", "hf"),
    "--load-format": ("auto", "safetensors"),
    "--model-impl": ("auto", "vllm"),
    "--api-server-count": ("1",),
    "--data-parallel-size-local": ("1",),
    "--data-parallel-rank": ("0",),
    "--nnodes": ("1",),
    "--node-rank": ("0",),
    "--response-role": ("assistant",),
    "--distributed-executor-backend": ("mp", "uni"),
}

# On the render tier only these values are checked (the rest are engine settings there).
RENDER_VALUE_CHECKS = ("--tokenizer-mode", "--response-role")

# Why an accepted flag changes nothing here, by the words in its name (first match). The render tier runs no
# model: what is not front-end or multimodal there is an engine setting.
RENDER_NOTES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("mm-", "media", "video", "interleave-mm", "language-model-only"),
     "multimodal settings: text prompts only here (an image part is a 400)"),
    (("log", "docs", "access", "request-id", "tokenizer", "h11", "sse-keep-alive", "anthropic", "cohere",
      "chat-template-content-format", "force-include-usage", "prompt-tokens-details", "server-load", "scale-out",
      "tokens-only", "revision", "environ-validation", "hf-token", "download-dir", "renderer-num-workers"),
     "a front-end setting with no counterpart here"),
)
RENDER_DEFAULT = "an engine setting: the render tier runs no model"
ENGINE_NOTES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("reasoning", "tool", "chat-template", "tokenizer", "response-role", "return-tokens-as-token-ids",
      "anthropic", "cohere", "trust-request", "generation-config"),
     "rendering and parser settings are the render tier's (the engine's derender runs the render tier's parsers)"),
    (("mm-", "media", "video", "interleave-mm", "language-model-only"),
     "this engine serves text models: a multimodal request is a 400"),
    (("log", "docs", "access", "request-id", "h11", "sse", "histogram", "metrics", "trace"),
     "logging and metrics are the engine's own: JSON logs with request ids, /metrics with vLLM's names"),
)
GENERIC_ENGINE = "a tuning knob of vLLM's engine with no counterpart in this engine: results are unchanged"


@dataclass(frozen=True)
class Disposition:
    kind: Literal["ours", "note", "refused"]
    why: str = ""


def vllm_flags() -> tuple[str, ...]:
    return VALUED + SWITCHES


def disposition(flag: str, tier: Tier, ours: Iterable[str], value: str | None = None) -> Disposition:
    """What ``tier`` does with vLLM's ``flag`` (given ``value``, for flags refused away from neutral values)."""
    if flag in set(ours):
        return Disposition("ours")
    refused = {**REFUSED_BOTH, **(REFUSED_ENGINE if tier == "engine" else REFUSED_RENDER)}
    if flag in refused:
        return Disposition("refused", refused[flag])
    neutral = NEUTRAL_VALUES.get(flag)
    if neutral and value is not None and value not in neutral and (tier == "engine" or flag in RENDER_VALUE_CHECKS):
        return Disposition("refused", f"only {' or '.join(neutral)} is supported here")
    if tier == "engine" and flag.startswith(("--no-", "--disable-")):
        return Disposition("note", "off is this engine's behaviour already")
    name = flag[2:]
    for words, why in ENGINE_NOTES if tier == "engine" else RENDER_NOTES:
        if any(w in name for w in words):
            return Disposition("note", why)
    return Disposition("note", GENERIC_ENGINE if tier == "engine" else RENDER_DEFAULT)


def _dest(flag: str) -> str:
    return "vllm_flag_" + flag[2:].replace("-", "_")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag the parser does not define itself, parsed so that it can be noted or refused."""
    defined = {o for a in parser._actions for o in a.option_strings}
    parser.set_defaults(vllm_flags_ours=frozenset(defined))
    group = parser.add_argument_group("other vLLM flags (accepted with a note in the log, or refused with a reason)")
    for flag in VALUED:
        if flag not in defined:
            group.add_argument(flag, dest=_dest(flag), default=None, metavar="VALUE", help=argparse.SUPPRESS)
    for flag in SWITCHES:
        if flag not in defined:
            group.add_argument(flag, dest=_dest(flag), action="store_const", const=True, default=None,
                               help=argparse.SUPPRESS)


def check_vllm_flags(args: argparse.Namespace, tier: Tier, log: logging.Logger) -> str | None:
    """Log a note for each accepted vLLM flag that was given; the one-line refusal of the first refused one."""
    ours = args.vllm_flags_ours
    for flag in vllm_flags():
        given = getattr(args, _dest(flag), None)
        if given is None or flag in ours:
            continue
        d = disposition(flag, tier, ours, None if given is True else str(given))
        shown = flag if given is True else f"{flag} {given}"
        if d.kind == "refused":
            return f"{shown} is not supported: {d.why}"
        log.info("%s: accepted for vLLM compatibility, no effect (%s)", shown, d.why)
    return None
