"""The engine: the step loop that ties scheduler, model runner, sampler and KV connector together.

`LLMEngine` is synchronous (`add_request`, `abort_request`, `step`), so tests can drive it step by step.
`AsyncEngine` runs it on a thread and hands each request's updates to an asyncio queue; requests and aborts
reach the thread through an inbox, so every engine data structure is touched by one thread only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from splitserve_common.block_hashes import BlockHashConfig
from token_engine.core.bad_words import BadWordsTokenizer, banned_next_tokens
from token_engine.core.kv_cache import BlockManager
from token_engine.core.model_runner import ModelRunner, kv_block_bytes
from token_engine.core.model_tokenizer import ModelTokenizer
from token_engine.core.sampler import Sampler, SamplingRow
from token_engine.core.scheduler import Scheduler
from token_engine.core.sequence import SamplingOptions, Sequence, TokenLogprob
from token_engine.core.step_budget import STEP_TIME_CONTEXT, BucketStepTimes, PrefillPolicy
from token_engine.http.metrics import EngineMetrics
from token_engine.http.validation import EngineLimits
from token_engine.kv_connector.base import KVConnector, create_kv_connector
from token_engine.kv_events.stream import open_kv_event_stream
from token_engine.kv_offload.config import host_tier_bytes, split_connectors
from token_engine.kv_offload.host_tier import HostKVTier, kv_fingerprint
from token_engine.rl.control import epoch_salt, weight_spans
from token_engine.rl.logprob_controls import forced_token, prompt_entries
from token_engine.structured import GrammarCompiler, GrammarState
from token_engine.structured.pool import PoolLimits

if TYPE_CHECKING:
    from prometheus_client import Counter

    from token_engine.models import CausalLM
    from token_engine.models.arch import ModelArch

log = logging.getLogger("token_engine")

CPU_KV_CACHE_MAX_BYTES = 4 << 30  # as vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE=4)
CUDA_ACTIVATION_RESERVE_BYTES = 2 << 30  # activations, logits and decode graphs live outside the KV pool
VOCABULARY_LOAD_WAIT_S = 60.0  # shutdown waits this long for the grammar vocabulary's load (a few s, more loaded)


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    seed: int = 0
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    enforce_eager: bool = False  # CUDA: no decode graphs
    kv_transfer_config: dict[str, Any] | None = None
    # vLLM's --kv-events-config: prefix-cache events for routers, over ZMQ
    kv_events_config: dict[str, Any] | None = None
    prefix_caching_hash_algo: str = "sha256"  # vLLM's block hash in KV events: sha256 or sha256_cbor
    kv_offloading_size: float | None = None  # GiB of host memory for evicted KV blocks (vLLM's flag)
    kv_offloading_backend: str | None = None  # vLLM's flag: "native" (host memory) is what is served
    structured_outputs_compile_timeout_s: float = 10.0  # a grammar compiling longer fails its request (400)
    tokenizer: str | None = None  # where structured outputs read tokenizer.json (vLLM's --tokenizer); default model
    generation_config: str = "auto"  # EOS ids: "auto" (the model's), "vllm" (config.json only) or a directory
    logprobs_mode: str = "raw_logprobs"  # or "raw_logits": what sampled-token logprobs carry (vLLM's flag)
    structured_outputs_compile_workers: int = 2  # killable compile processes (structured/pool.py)
    prefill_policy: PrefillPolicy | None = None  # step budget and vLLM's long-prompt knobs (step_budget.py)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class SequenceDelta:
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: int | None = None
    weight_versions: list[tuple[str, int, int]] | None = None  # (version, start, end) of output, on the last delta


@dataclass
class RequestUpdate:
    request_id: str
    deltas: list[SequenceDelta]
    finished: bool = False  # every sequence of the request has finished
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestState:
    request_id: str
    seqs: list[Sequence]
    on_update: Callable[[RequestUpdate], None]
    arrival: float = field(default_factory=time.monotonic)
    emitted: list[int] = field(default_factory=list)  # output tokens already handed out, per sequence
    last_token_time: list[float] = field(default_factory=list)


def decide_num_blocks(config: EngineConfig, arch: ModelArch, max_model_len: int) -> int:
    per_block = kv_block_bytes(arch, config.block_size)
    if config.num_gpu_blocks_override:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes:
        return max(1, config.kv_cache_memory_bytes // per_block)
    if config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        budget = int(total * config.gpu_memory_utilization) - (total - free) - CUDA_ACTIVATION_RESERVE_BYTES
        return max(1, budget // per_block)
    wanted = -(-max_model_len * min(config.max_num_seqs, 8) // config.block_size)
    return max(1, min(wanted, CPU_KV_CACHE_MAX_BYTES // per_block))


class LLMEngine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None, connector: KVConnector | None = None,
                 host_tier: HostKVTier | None = None):
        """`host_tier`: a tier to reuse (kept only if this engine's fingerprint matches its entries'); by
        default one is built when offloading is configured."""
        from token_engine.models import load_model
        from token_engine.models.arch import read_eos_token_ids

        self.config = config
        if config.max_num_batched_tokens < config.max_num_seqs:
            # Otherwise the lowest-priority running sequences would never get a decode token (as vLLM checks).
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({config.max_num_seqs})")
        self.model = model if model is not None else load_model(config.model, dtype=config.dtype, device=config.device)
        arch = self.model.arch
        self.arch = arch
        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        self.num_blocks = decide_num_blocks(config, arch, self.max_model_len)
        if self.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * config.block_size} tokens ({self.num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len={self.max_model_len}: lower --max-model-len "
                f"or give the cache more memory")
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = open_kv_event_stream(config.kv_events_config,
                                              BlockHashConfig(config.block_size, config.prefix_caching_hash_algo))
        if self.kv_events is not None:
            self.block_manager.events = self.kv_events.recorder
        capacity = host_tier_bytes(config.kv_transfer_config, config.kv_offloading_size, config.kv_offloading_backend,
                                   config.block_size, kv_block_bytes(arch, config.block_size))
        if host_tier is None and capacity is not None:
            host_tier = HostKVTier(capacity)
        self.host_tier = host_tier
        self.connector = connector if connector is not None else create_kv_connector(
            split_connectors(config.kv_transfer_config)[0], config)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.connector, config.prefill_policy)
        self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, config.device,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  cuda_graphs=not config.enforce_eager,
                                  max_num_batched_tokens=config.max_num_batched_tokens)
        if self.runner.mixed_graphs is not None:  # the step budget fills padded steps to their bucket
            self.scheduler.step_token_buckets = tuple(self.runner.mixed_graphs.layout.token_buckets)
            if self.scheduler.policy.target_step_ms > 0:
                started = time.perf_counter()
                measured = self.runner.mixed_graphs.time_buckets(min(STEP_TIME_CONTEXT, self.max_model_len))
                self.scheduler.bucket_times = BucketStepTimes(measured)
                log.info("step budget: mixed-step replay times measured in %.1f s (ms; ms more per 1k of context): %s",
                         time.perf_counter() - started,
                         ", ".join(f"{b}: {ms:.2f}; {per_k:.3f}" for b, (ms, per_k) in measured.items()))
        self.connector.bind_kv_pool(self.runner.kv_pool, config.block_size)
        if self.host_tier is not None:
            pool = self.runner.kv_pool
            self.host_tier.bind(pool, kv_fingerprint(config.model, pool.dtype, tuple(pool.shape[1:])))
            self.host_tier.events = self.kv_events.recorder if self.kv_events is not None else None
            self.block_manager.host = self.host_tier
        self.sampler = Sampler(config.seed, config.logprobs_mode)
        self.eos_token_ids = frozenset(arch.eos_token_ids if config.generation_config == "auto"
                                       else read_eos_token_ids(config.model, config.generation_config))
        # The vocabulary is read from the model (or --tokenizer) directory on the first structured request only.
        self.grammars = GrammarCompiler(config.tokenizer or config.model, arch.vocab_size, sorted(self.eos_token_ids),
                                        config.structured_outputs_compile_timeout_s,
                                        pool_limits=PoolLimits(workers=config.structured_outputs_compile_workers))
        # bad_words and the text output modes read the same directory's tokenizer.json, on first use
        self.tokenizer = ModelTokenizer(config.tokenizer or config.model)
        self.bad_words = BadWordsTokenizer(config.tokenizer or config.model, arch.vocab_size, self.tokenizer)
        self.limits = EngineLimits(arch.vocab_size, self.max_model_len, config.max_num_seqs, config.max_logprobs)
        self.metrics = EngineMetrics(config.model_name)
        self._step_phases = {name: self.metrics.label(self.metrics.step_phase, phase=name)
                             for name in ("idle", "schedule", "model", "bookkeeping")}
        self._last_step_end: float | None = None
        self.requests: dict[str, RequestState] = {}
        self._seq_request: dict[str, RequestState] = {}
        self._seen_prefix = (0, 0)
        self._seen_preemptions = 0
        # RL weight updates (token_engine/rl): the label of the live weights and how often they changed
        self.weight_version = "default"
        self.weight_epoch = 0
        self._seen_kv_events = (0, 0)
        self._seen_totals: dict[str, float] = {}

    # ---- requests ---------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_request(self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, n: int = 1,
                    priority: int = 0, cache_salt: str | None = None, kv_transfer_params: dict[str, Any] | None = None,
                    on_update: Callable[[RequestUpdate], None] | None = None,
                    caller: str | None = None) -> RequestState:
        """`caller` (the client address, None in process) is who the connector's lease budget charges."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seq_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        if any(seq_id in self.scheduler.loading for seq_id in seq_ids):
            # An aborted request whose KV load is still writing its blocks: its sequences keep their ids until
            # the copies finish and the blocks are freed, and a sequence of the same id would take its place.
            raise ValueError(f"request id {request_id!r} is still finishing (a KV load it started is under way); "
                             "use another id or retry shortly")
        if options.structured is not None and options.grammar is None:
            # Synchronous callers only: the server compiles off this thread before it adds the request.
            options = dataclasses.replace(options, grammar=self.grammars.compile(options.structured))
        event_salt, cache_salt = cache_salt, epoch_salt(cache_salt, self.weight_epoch)  # older KV is never reused
        seqs = []
        for i in range(n):
            opts = options
            if i > 0:
                # Children differ in seed (as vLLM: seed + index) and compute prompt logprobs once.
                opts = dataclasses.replace(options, seed=None if options.seed is None else options.seed + i,
                                           prompt_logprobs=None)
            seqs.append(Sequence(
                seq_id=seq_ids[i], request_id=request_id, index=i,
                prompt_token_ids=prompt_token_ids, options=opts, eos_token_ids=self.eos_token_ids,
                priority=priority, cache_salt=cache_salt, event_salt=event_salt, weight_epoch=self.weight_epoch,
                kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params is not None else None,
                weight_marks=[(self.weight_version, 0)]))
        refusal = self.connector.admit(seqs, caller)
        if refusal is not None:
            raise ValueError(refusal)
        if options.grammar is not None:
            stops = options.stop_token_ids | (frozenset() if options.ignore_eos else self.eos_token_ids)
            reasoning_end = self.grammars.reasoning_end_token_id if options.structured_after_reasoning else None
            for seq in seqs:  # n > 1: one compiled grammar, a matcher per sequence
                seq.grammar = GrammarState(options.grammar, stops, reasoning_end)
        if self.runner.device.type != "cpu":
            for seq in seqs:
                if seq.options.seed is not None:  # draw a seeded sequence's noise where the logits are
                    seq.generator = torch.Generator(device=self.runner.device).manual_seed(seq.options.seed)
        state = RequestState(request_id, seqs, on_update or (lambda update: None))
        state.emitted = [0] * n
        state.last_token_time = [0.0] * n
        self.requests[request_id] = state
        for seq in seqs:
            if seq.options.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            self._seq_request[seq.seq_id] = state
            self.scheduler.add(seq)
        self.metrics.label(self.metrics.prompt_tokens).inc(len(prompt_token_ids))
        return state

    def abort_request(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:  # finished: it may still hold KV for a peer (a decode hop that failed)
            for seq_id in self.connector.abort_held(request_id):
                self.scheduler.release_held(seq_id)
            return
        for seq in state.seqs:
            self.scheduler.abort(seq)
        self._emit(state)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """End one sequence of a request as "stop" (a stop string the server found in its text); the others
        go on."""
        state = self.requests.get(request_id)
        if state is None or not 0 <= index < len(state.seqs):
            return
        self.scheduler.finish(state.seqs[index], "stop")
        self._emit(state)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Runs one scheduling step. Returns whether any model work was done."""
        touched: dict[str, RequestState] = {}
        t_start = time.perf_counter()
        # Loads under way (a peer's, the host tier's) are polled, never waited for: their sequences run once done.
        for seq in [*self.scheduler.apply_connector_events(self.connector.poll()), *self.scheduler.apply_host_loads()]:
            touched[seq.request_id] = self._seq_request[seq.seq_id]
        out = self.scheduler.schedule()
        t_scheduled = t_model = time.perf_counter()
        for seq in out.preempted:
            touched.setdefault(seq.request_id, self._seq_request[seq.seq_id])
        if self.host_tier is not None:  # evicted blocks the step may overwrite: their copies to host go first
            self.host_tier.fence()
        if out.scheduled:
            logits = self.runner.execute(out.scheduled)
            if self.host_tier is not None:  # the forward is queued: the evictions' host copies go out meanwhile
                self.host_tier.drain()
            sampling = [s.seq for s in out.scheduled if s.samples]
            sampled: dict[str, int] = {}
            if sampling:
                tokens, logprobs = self.sampler(logits.sample_logits, [self._sampling_row(seq) for seq in sampling])
                for seq, token, lp in zip(sampling, tokens, logprobs):
                    sampled[seq.seq_id] = token
                    if lp is not None:
                        seq.new_logprobs.append(lp)
            for seq_id, (first, rows) in logits.prompt_logits.items():
                self._record_prompt_logprobs(self._seq_by_id(seq_id), first, rows)
            t_model = time.perf_counter()
            self.scheduler.observe_step(self.runner.last_step_tokens, t_model - t_scheduled, out)
            self.scheduler.update_after_step(out, sampled)
            for s in out.scheduled:
                touched.setdefault(s.seq.request_id, self._seq_request[s.seq.seq_id])
        for state in touched.values():
            self._emit(state)
        if self.kv_events is not None:
            self.kv_events.flush()
        self._update_gauges()
        if out.scheduled:
            self._observe_step(t_start, t_scheduled, t_model, time.perf_counter())
        return bool(out.scheduled)

    def _count_up(self, key: str, total: float, counter: Counter) -> None:
        """Advances a Prometheus counter to a running total kept elsewhere."""
        seen = self._seen_totals.get(key, 0)
        if total != seen:
            counter.inc(total - seen)
            self._seen_totals[key] = total

    def _observe_step(self, start: float, scheduled: float, modeled: float, end: float) -> None:
        phases = self._step_phases
        if self._last_step_end is not None:
            phases["idle"].observe(start - self._last_step_end)
        phases["schedule"].observe(scheduled - start)
        phases["model"].observe(modeled - scheduled)
        phases["bookkeeping"].observe(end - modeled)
        self._last_step_end = end

    def _seq_by_id(self, seq_id: str) -> Sequence:
        state = self._seq_request[seq_id]
        return next(s for s in state.seqs if s.seq_id == seq_id)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        opts = seq.options
        blocked: frozenset[int] = frozenset()
        if seq.num_output_tokens < opts.min_tokens:
            blocked = opts.stop_token_ids | (frozenset() if opts.ignore_eos else seq.eos_token_ids)
        # Output history is only read by penalties; copying it every step would cost O(length) per token.
        history = seq.output_token_ids if opts.needs_penalties else []
        banned = (banned_next_tokens(opts.bad_words_token_ids, seq.token_ids, seq.prompt_len)
                  if opts.bad_words_token_ids else ())
        return SamplingRow(opts, seq.prompt_token_ids, history, seq.generator, blocked, seq.grammar,
                           forced_token(opts, seq.num_output_tokens), banned)

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        k = seq.options.prompt_logprobs or 0
        targets = torch.tensor(seq.token_ids[first + 1:first + 1 + logits.shape[0]], device=logits.device)
        entries = prompt_entries(seq.options, first, logits.float().log_softmax(dim=1), targets, k)
        for offset, entry in enumerate(entries):
            if len(seq.prompt_logprobs) == first + 1 + offset:  # a recompute after preemption adds nothing
                seq.prompt_logprobs.append(entry)

    def _emit(self, state: RequestState) -> None:
        now = time.monotonic()
        m = self.metrics
        deltas = []
        for i, seq in enumerate(state.seqs):
            if state.emitted[i] < 0:  # its final delta is out
                continue
            new = seq.token_ids[seq.prompt_len + state.emitted[i]:]
            if not new and not seq.is_finished:
                continue
            if new:
                if state.emitted[i] == 0:
                    m.ttft_l.observe(now - state.arrival)
                else:
                    m.itl_l.observe((now - state.last_token_time[i]) / len(new))
                state.last_token_time[i] = now
                m.generation_tokens_l.inc(len(new))
            logprobs, seq.new_logprobs = seq.new_logprobs, []
            deltas.append(SequenceDelta(seq.index, new, logprobs, seq.finish_reason, seq.stop_reason,
                                        weight_spans(seq.weight_marks, seq.num_output_tokens)
                                        if seq.is_finished else None))
            state.emitted[i] = -1 if seq.is_finished else state.emitted[i] + len(new)
        if not deltas:
            return
        finished = all(seq.is_finished for seq in state.seqs)
        update = RequestUpdate(state.request_id, deltas, finished)
        if finished:
            self.requests.pop(state.request_id, None)
            for seq in state.seqs:
                self._seq_request.pop(seq.seq_id, None)
            first = state.seqs[0]
            update.kv_transfer_params = first.kv_transfer_params_out
            update.num_cached_tokens = first.num_cached_tokens
            update.error = next((s.error for s in state.seqs if s.error), None)
            if first.options.prompt_logprobs is not None:
                update.prompt_logprobs = first.prompt_logprobs
            m.e2e_l.observe(now - state.arrival)
            m.label(m.success, finished_reason=first.finish_reason or "stop").inc()
        state.on_update(update)

    def _update_gauges(self) -> None:
        m, bm, sched = self.metrics, self.block_manager, self.scheduler
        m.label(m.running).set(len(sched.running))
        m.label(m.waiting).set(len(sched.waiting) + len(sched.waiting_for_remote))
        m.label(m.kv_usage).set(bm.usage())
        m.label(m.free_blocks).set(bm.num_free_blocks())
        q, h = bm.prefix_queries, bm.prefix_hits
        if (q, h) != self._seen_prefix:
            m.label(m.prefix_queries).inc(q - self._seen_prefix[0])
            m.label(m.prefix_hits).inc(h - self._seen_prefix[1])
            self._seen_prefix = (q, h)
        self._count_up("external_queries", bm.external_queries, m.label(m.external_queries))
        self._count_up("external_hits", bm.external_hits, m.label(m.external_hits))
        self._count_up("cached", sum(bm.cached_by_source.values()), m.label(m.cached_tokens))
        for source, n in bm.cached_by_source.items():
            self._count_up(f"source:{source}", n, m.label(m.cached_by_source, source=source))
        if self.host_tier is not None:
            tier = self.host_tier
            m.label(m.offload_usage).set(tier.usage())
            self._count_up("load_bytes", tier.loaded_bytes, m.label(m.offload_load_bytes))
            self._count_up("store_bytes", tier.stored_bytes, m.label(m.offload_store_bytes))
            self._count_up("load_time", tier.load_time, m.label(m.offload_load_time))
            self._count_up("store_time", tier.store_seconds, m.label(m.offload_store_time))
        if self.kv_events is not None:
            pub = self.kv_events.publisher
            seen = self._seen_kv_events
            if (pub.num_events_published, pub.num_dropped) != seen:
                m.label(m.kv_events_published).inc(pub.num_events_published - seen[0])
                m.label(m.kv_event_batches_dropped).inc(pub.num_dropped - seen[1])
                self._seen_kv_events = (pub.num_events_published, pub.num_dropped)
        if sched.num_preemptions != self._seen_preemptions:
            m.label(m.preemptions).inc(sched.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = sched.num_preemptions

    def fail_all(self, message: str) -> None:
        """After an unexpected step failure: end every request with an error and give back its blocks."""
        for state in list(self.requests.values()):
            for seq in state.seqs:
                self.scheduler.finish(seq, "error", message)
            self._emit(state)

    # ---- convenience for tests and scripts ---------------------------------------------------------
    def generate(self, prompts: list[list[int]], options: SamplingOptions, max_steps: int = 100_000) -> list[list[int]]:
        """Runs prompts to completion synchronously; returns the output token ids of each."""
        results: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            rid = f"offline-{i}-{id(results)}"
            results[rid] = []
            self.add_request(rid, prompt, options, on_update=_collect_into(results[rid]))
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        return list(results.values())

    def shutdown(self) -> None:
        # kills compile workers (a compile still waited for fails with a 503), once a vocabulary load under
        # way has ended: the process exits after this
        self.grammars.close(wait_s=VOCABULARY_LOAD_WAIT_S)
        self.connector.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def new_weight_epoch(self) -> None:
        """New weights: later requests hash their blocks under the next epoch, the cached index is dropped, and
        routers hear AllBlocksCleared; blocks that sequences begun under older weights still write are not
        published (their KV is not what a new request would compute)."""
        self.weight_epoch += 1
        if self.kv_events is not None:
            self.kv_events.recorder.weight_epoch = self.weight_epoch
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> int:
        """Drops the prefix-cache index and the host tier's blocks (new weights, a trainer's reset, sleep): a
        router hears AllBlocksCleared at once. Returns the device index entries dropped."""
        dropped = self.block_manager.reset_prefix_cache()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.kv_events is not None:
            self.kv_events.flush()
        return dropped


def _collect_into(tokens: list[int]) -> Callable[[RequestUpdate], None]:
    """An on_update that appends every output token to `tokens`."""
    def on_update(update: RequestUpdate) -> None:
        tokens.extend(t for d in update.deltas for t in d.token_ids)
    return on_update


# What reaches the engine thread through AsyncEngine's inbox.
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    n: int
    priority: int
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    on_update: Callable[[RequestUpdate], None]
    caller: str | None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class EngineCall:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future[object]


InboxItem = AddRequest | AbortRequest | EngineCall


class AsyncEngine:
    """Runs an LLMEngine on its own thread; the asyncio side adds requests, aborts and reads updates."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[InboxItem] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="token-engine", daemon=True)
        self.dead: str | None = None
        self.frozen = False  # paused with mode=keep, or asleep: requests stay where they are, no step runs
        self.refusal: str | None = None  # paused (abort/wait) or asleep: new generate requests get a 503 with this

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def submit(self, item: InboxItem) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def add_request(self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, n: int,
                    priority: int, cache_salt: str | None, kv_transfer_params: dict[str, Any] | None,
                    on_update: Callable[[RequestUpdate], None], caller: str | None = None) -> None:
        self.submit(AddRequest(request_id, prompt_token_ids, options, n, priority, cache_salt, kv_transfer_params,
                               on_update, caller))

    def abort_request(self, request_id: str) -> None:
        self.submit(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future[object]:
        """Runs ``fn(engine)`` on the engine thread between steps (control operations); its result or error."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self.submit(EngineCall(fn, future))
        return future

    def set_frozen(self, frozen: bool) -> None:
        with self._cv:
            self.frozen = frozen
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.shutdown()

    def _drain_inbox(self) -> None:
        with self._cv:
            items, self._inbox = self._inbox, []
        for item in items:
            if isinstance(item, AddRequest):
                try:
                    self.engine.add_request(item.request_id, item.prompt_token_ids, item.options, item.n,
                                            item.priority, item.cache_salt, item.kv_transfer_params,
                                            on_update=item.on_update, caller=item.caller)
                except Exception as exc:  # e.g. a duplicate id raced past the server's check
                    item.on_update(RequestUpdate(item.request_id, [], finished=True, error=str(exc)))
            elif isinstance(item, AbortRequest):
                self.engine.abort_request(item.request_id)
            elif item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(item.fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    item.future.set_exception(exc)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                self._drain_inbox()
                worked = False
                sched = self.engine.scheduler
                if (self.engine.has_work() or sched.held_by_connector) and not self.frozen:
                    try:
                        worked = self.engine.step()
                    except Exception as exc:
                        log.exception("engine step failed")
                        self.engine.fail_all(f"engine step failed: {exc}")
                        worked = True
                if worked:
                    continue
                with self._cv:
                    if self._inbox or self._stop:
                        continue
                    # Transfers in flight need polling about every millisecond; otherwise sleep until work.
                    if self.frozen:
                        self._cv.wait()
                    elif self.engine.connector.has_inflight_transfers() or sched.waiting_for_remote:
                        self._cv.wait(0.001)
                    elif sched.held_by_connector or self.engine.has_work():
                        self._cv.wait(0.01)
                    else:
                        self._cv.wait()
        except BaseException as exc:  # noqa: BLE001 - reported through /health
            self.dead = repr(exc)
            log.exception("engine thread died")
            try:  # waiting callers get an error instead of hanging
                self.engine.fail_all(f"engine thread died: {exc!r}")
            except Exception:  # noqa: BLE001
                log.exception("could not fail the remaining requests")
