"""One generated sequence (a request with n=3 becomes three) and its validated sampling options."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from token_engine.structured import GrammarState, GuideSpec


@dataclass(frozen=True)
class SamplingOptions:
    """Validated, engine-internal sampling settings of one sequence (http/protocol.py builds them)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k count; 0 = only the sampled token
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # bad_words, tokenized (core/bad_words.py)
    skip_prefix_cache: bool = False  # skip_reading_prefix_cache
    structured: GuideSpec | None = None  # structured_outputs
    structured_after_reasoning: bool = False  # reasoning_ended false: unconstrained until </think>
    grammar: Any = field(default=None, compare=False)  # `structured` compiled (before the request is added)
    # RL logprob controls (token_engine/rl/logprob_controls.py)
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprob_token_ids: tuple[tuple[int, ...], ...] | None = None
    prompt_logprob_start: int | None = None
    trace_decode_token_ids: tuple[int, ...] | None = None  # teacher forcing: emitted instead of sampled

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Logprob of a sampled (or prompt) token plus the top alternatives, rank-ordered (rank 1 = best)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token_id, logprob), rank i+1 at index i
    top_ranks: list[int] | None = None  # the ranks of `top` when it is not the top-k (logprob_token_ids)


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # choice index within the request
    prompt_token_ids: list[int]
    options: SamplingOptions
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None  # what the prefix cache hashes under: the client's salt and the weight epoch
    # What routers hash the blocks under (KV events): the client's salt alone, as render and vLLM hash them; and
    # the weights the sequence started under (its blocks are published only while those are the engine's).
    event_salt: str | None = None
    weight_epoch: int = 0
    kv_transfer_params: dict | None = None  # from the request, for the connector
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))

    token_ids: list[int] = field(init=False)  # prompt + output
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks of token_ids, in order
    num_computed_tokens: int = 0  # tokens whose K/V is in the pool
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache or a peer at admission
    num_preemptions: int = 0
    kv_transfer_params_out: dict | None = None  # the connector's answer, returned on the response
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None  # the token id that ended it with "stop" (vLLM's stop_reason)
    error: str | None = None
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # structured outputs: where the output stands in its grammar
    # filled by the engine as tokens are produced; drained by whoever streams them out
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # (weight version, first output token it sampled): the engine adds one when its weights change mid-request
    weight_marks: list[tuple[str, int]] = field(default_factory=lambda: [("default", 0)])

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.options.seed is not None:
            # Per-sequence generator: reproducible whatever else shares the batch.
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(self.options.seed)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority value, then arrival (vLLM's priority policy)."""
        return (self.priority, self.arrival_order)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:  # the one place output grows, so the grammar never advances twice
            self.grammar.accept(token_id)
