"""Turns a batch of logits into tokens, vectorized over the batch.

Order (as vLLM v1): structured-outputs grammar mask -> logit bias / allowed ids / min_tokens masking /
bad words -> penalties -> greedy argmax or temperature -> min_p -> top_k -> top_p -> exponential-race sampling.
Logprobs are the raw model log-softmax (vLLM's default `raw_logprobs`), before any of that processing,
the grammar mask included; with `--logprobs-mode raw_logits` the raw logits themselves (same ranks).

Seeded rows draw their noise from their own generator, one draw of vocab size per step, so a seeded
request yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from token_engine.core.sequence import SamplingOptions, TokenLogprob
from token_engine.structured import GrammarState, apply_grammars_


@dataclass
class SamplingRow:
    options: SamplingOptions
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_ids_blocked: frozenset[int]  # ids masked while min_tokens is not reached (EOS + stop ids)
    grammar: GrammarState | None = None  # structured outputs: only what the grammar allows next
    forced: int | None = None  # trace_decode_token_ids: the token emitted this step whatever was sampled
    banned: tuple[int, ...] = ()  # bad_words whose other tokens were just generated: their last one, this step


def with_token_ids(entry: TokenLogprob, log_probs: torch.Tensor, ids: Sequence[int]) -> TokenLogprob:
    """``entry`` with its alternatives replaced by the given ids' logprobs and real ranks (-1: -inf, rank None)."""
    wanted = [t for t in ids if t >= 0]
    if not wanted:
        entry.top, entry.top_ranks = [], []
        return entry
    index = torch.tensor(wanted, device=log_probs.device)
    values = log_probs.index_select(0, index)
    ranks = ((log_probs[None, :] > values[:, None]).sum(dim=1) + 1).tolist()
    entry.top = list(zip(wanted, values.tolist()))
    entry.top_ranks = ranks
    return entry


def logprobs_of(log_probs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """TokenLogprob per row of log_probs [N, V] for token_ids [N], with the top-k alternatives."""
    chosen = log_probs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (log_probs > chosen[:, None]).sum(dim=1) + 1
    top_vals: list[list[float]]
    top_ids: list[list[int]]
    if k > 0:
        values, ids = log_probs.topk(k, dim=1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    else:
        top_vals = [[] for _ in range(log_probs.shape[0])]
        top_ids = [[] for _ in range(log_probs.shape[0])]
    out = []
    for i, (tid, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.tolist(), ranks.tolist())):
        out.append(TokenLogprob(tid, lp, rank, list(zip(top_ids[i], top_vals[i]))))
    return out


LOGPROBS_MODES = ("raw_logprobs", "raw_logits")  # vLLM's processed_* would need the processed logits kept


class Sampler:
    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode {logprobs_mode} is not supported (one of {', '.join(LOGPROBS_MODES)})")
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self._device_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [B, V] float32 (one row per entry of rows) -> (token ids, logprobs or None per row)."""
        logits = logits.float()
        batch, vocab = logits.shape
        device = logits.device
        raw = logits
        edits = any(r.options.needs_penalties or r.options.logit_bias or r.options.allowed_token_ids is not None
                    or r.stop_ids_blocked or r.banned or r.grammar is not None for r in rows)
        if edits:  # never touch the caller's logits: raw ones feed the logprobs
            logits = logits.clone()
            apply_grammars_(logits, [r.grammar for r in rows])
            self._apply_masks_and_bias(logits, rows)
            if any(r.options.needs_penalties for r in rows):
                self._apply_penalties(logits, rows, vocab)
        tokens = self._choose(logits, rows, batch, vocab)
        forced = [(i, r.forced) for i, r in enumerate(rows) if r.forced is not None]
        if forced:  # teacher forcing: the given token, with its real logprob below
            tokens[torch.tensor([i for i, _ in forced], device=device)] = torch.tensor(
                [t for _, t in forced], device=device, dtype=tokens.dtype)

        token_list = tokens.tolist()
        logprob_out: list[TokenLogprob | None] = [None] * batch
        want = {i: r.options.logprobs for i, r in enumerate(rows) if r.options.logprobs is not None}
        if want:
            idx = torch.tensor(list(want), device=device)
            log_probs = raw.index_select(0, idx)
            if self.logprobs_mode == "raw_logprobs":
                log_probs = log_probs.log_softmax(dim=1)
            entries = logprobs_of(log_probs, tokens.index_select(0, idx), max(want.values()))
            for row, ((i, top), entry) in enumerate(zip(want.items(), entries)):
                entry.top = entry.top[:top]
                wanted_ids = rows[i].options.logprob_token_ids
                if wanted_ids is not None:
                    entry = with_token_ids(entry, log_probs[row], wanted_ids)
                logprob_out[i] = entry
        return token_list, logprob_out

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], batch: int, vocab: int) -> torch.Tensor:
        opts = [r.options for r in rows]
        tokens = logits.argmax(dim=1)
        if all(o.greedy for o in opts):
            return tokens
        # Every branch is decided on the host and the per-row knobs travel in one copy: on a GPU each
        # device-side `.any()` or small tensor upload is a synchronization.
        knobs = torch.tensor([[1.0 if o.greedy else o.temperature, o.top_p, o.min_p,
                               float(o.top_k if 0 < o.top_k < vocab else vocab), float(o.greedy)] for o in opts],
                             dtype=torch.float32).to(logits.device)
        temps, top_p, min_p, top_k, greedy = knobs.unbind(1)
        scaled = logits / temps[:, None]
        if any(o.min_p > 0 for o in opts):
            probs = scaled.softmax(dim=1)
            threshold = probs.max(dim=1, keepdim=True).values * min_p[:, None]
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        with_top_k = [0 < o.top_k < vocab for o in opts]
        if any(with_top_k) or any(o.top_p < 1.0 for o in opts):
            # Only the best max(top_k) candidates can survive when every row has a top_k: a partial topk is
            # far cheaper than sorting the whole vocabulary.
            width = max(o.top_k for o in opts) if all(with_top_k) else vocab
            sorted_logits, order = scaled.topk(width, dim=1) if width < vocab else scaled.sort(dim=1, descending=True)
            positions = torch.arange(width, device=logits.device)[None, :]
            sorted_logits = sorted_logits.masked_fill(positions >= top_k[:, None], float("-inf"))
            probs = sorted_logits.softmax(dim=1)
            # Drop a token when the tokens ranked above it already reach top_p; the best one always stays.
            drop = (probs.cumsum(dim=1) - probs) > top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)
        probs = scaled.softmax(dim=1)
        sampled = (probs / self._exponential_noise(rows, batch, vocab, logits.device)).argmax(dim=1)
        if any(o.greedy for o in opts):
            sampled = torch.where(greedy.bool(), tokens, sampled)
        return sampled

    # ---- steps ------------------------------------------------------------------------------------
    @staticmethod
    def _apply_masks_and_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            opts = r.options
            if opts.allowed_token_ids is not None:
                keep = torch.full_like(logits[i], float("-inf"))
                ids = torch.tensor(opts.allowed_token_ids, device=logits.device)
                keep[ids] = 0.0
                logits[i] += keep
            if opts.logit_bias:
                ids = torch.tensor([t for t, _ in opts.logit_bias], device=logits.device)
                bias = torch.tensor([b for _, b in opts.logit_bias], device=logits.device)
                logits[i].index_add_(0, ids, bias)
            blocked = [t for t in r.stop_ids_blocked if t < logits.shape[1]]  # EOS ids may lie past a small vocab
            if blocked:
                logits[i].index_fill_(0, torch.tensor(blocked, device=logits.device), float("-inf"))
            if r.banned:  # a row of its own: requests without bad words pay nothing
                logits[i].index_fill_(0, torch.tensor(r.banned, device=logits.device), float("-inf"))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
        device = logits.device
        # Output-token counts per row; padding points at an extra column that is dropped.
        max_out = max(1, max(len(r.output_token_ids) for r in rows))
        out_ids = torch.full((len(rows), max_out), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            if r.output_token_ids:
                out_ids[i, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids)
        out_ids = out_ids.to(device)
        counts = torch.zeros(len(rows), vocab + 1, device=device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]

        if any(r.options.repetition_penalty != 1.0 for r in rows):
            rep = torch.tensor([r.options.repetition_penalty for r in rows], device=device)
            # Repetition penalty covers prompt and output tokens (as vLLM).
            seen = counts > 0
            for i, r in enumerate(rows):
                if r.options.repetition_penalty != 1.0 and r.prompt_token_ids:
                    seen[i, torch.tensor(r.prompt_token_ids, device=device)] = True
            factor = torch.where(logits > 0, 1.0 / rep[:, None], rep[:, None])
            logits.copy_(torch.where(seen, logits * factor, logits))
        freq = torch.tensor([r.options.frequency_penalty for r in rows], device=device)
        pres = torch.tensor([r.options.presence_penalty for r in rows], device=device)
        logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()

    def _exponential_noise(self, rows: list[SamplingRow], batch: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Noise drawn where the logits live: a [batch, vocab] host-to-device copy per step would cost more
        than the sampling itself on a GPU."""
        noise = torch.empty(batch, vocab, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == batch:
            return noise.exponential_(generator=self._generator_for(device))
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            fresh = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self._generator_for(device))
            noise.index_copy_(0, idx, fresh)
        for i, r in enumerate(rows):
            if r.generator is not None:
                if r.generator.device == noise.device:
                    noise[i].exponential_(generator=r.generator)
                else:
                    noise[i] = torch.empty(vocab, device=r.generator.device).exponential_(generator=r.generator)
        return noise

    def _generator_for(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        if device.type == "cpu":
            return self.generator
        key = str(device)
        if key not in self._device_generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._device_generators[key] = g
        return self._device_generators[key]
