"""The logprob controls RL trainers ask for, under vLLM's SamplingParams names.

- ``logprobs: 0`` (or ``return_token_logprobs``): the sampled token's logprob only, in float32.
- ``logprob_token_ids``: at each output step, the logprobs of exactly these ids (with their real ranks) in
  place of the top-k; at most MAX_LOGPROB_TOKEN_IDS, and ``logprobs``, if set, must equal their count (vLLM's rule).
- ``prompt_logprob_token_ids`` with ``prompt_logprob_start``: prompt row i scores its ids as predictions of
  prompt token ``start + i + 1``; rows before ``start`` answer None (vLLM's layout; -1 pads a row).
- ``trace_decode_token_ids``: teacher forcing. The engine emits exactly these tokens (max_tokens shrinks to
  their count; EOS and stop ids do not end it) and returns their real logprobs and ranks.

What the numbers are (``--logprobs-mode``): ``raw_logprobs`` is the model's log-softmax before temperature,
penalties, top-k/top-p/min-p and masks, so a trainer replaying the same weights gets the same value whatever
the sampling filters were; ``raw_logits`` returns the logits themselves. vLLM's ``processed_*`` modes (after
the filters: a token that top-p cut would show -inf) are refused, since trainers compare against raw replays.
"""

from __future__ import annotations

import dataclasses

import torch

from token_engine.core.sampler import logprobs_of, with_token_ids
from token_engine.core.sequence import SamplingOptions, TokenLogprob
from token_engine.http.request_error import RequestError

MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap


def apply_logprob_controls(sp, options: SamplingOptions, vocab_size: int, max_model_len: int,
                           prompt_len: int) -> SamplingOptions:
    """Validates the controls of a request's sampling params and folds them into its options."""
    changes: dict = {}
    ids = sp.logprob_token_ids
    if ids is not None:
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise RequestError(f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                               f"allowed: {MAX_LOGPROB_TOKEN_IDS}", "sampling_params.logprob_token_ids")
        _in_vocab("logprob_token_ids", ids, vocab_size)
        if sp.logprobs is not None and sp.logprobs != len(ids):
            raise RequestError(f"When both logprobs and logprob_token_ids are set, logprobs must equal "
                               f"len(logprob_token_ids). Got logprobs={sp.logprobs}, "
                               f"len(logprob_token_ids)={len(ids)}.", "sampling_params.logprob_token_ids")
        changes.update(logprob_token_ids=tuple(ids), logprobs=len(ids))
    rows = sp.prompt_logprob_token_ids
    start = sp.prompt_logprob_start
    if start is not None and not 0 <= start < max(prompt_len - 1, 1):
        raise RequestError(f"prompt_logprob_start must be in [0, {max(prompt_len - 1, 1)}) for a prompt of "
                           f"{prompt_len} tokens, got {start}", "sampling_params.prompt_logprob_start")
    if rows is not None:
        if not rows or not all(rows) or len(rows) > max_model_len - 1:
            raise RequestError("prompt_logprob_token_ids must be a non-empty integer array of shape "
                               "[num_rows, num_ids] with at most max_model_len - 1 rows.",
                               "sampling_params.prompt_logprob_token_ids")
        if (start or 0) + len(rows) > prompt_len - 1:
            raise RequestError(f"prompt_logprob_token_ids has {len(rows)} rows from row {start or 0}, but the "
                               f"prompt has {prompt_len - 1} scored rows", "sampling_params.prompt_logprob_token_ids")
        for row in rows:
            if len(row) > MAX_LOGPROB_TOKEN_IDS:
                raise RequestError(f"prompt_logprob_token_ids rows hold at most {MAX_LOGPROB_TOKEN_IDS} ids",
                                   "sampling_params.prompt_logprob_token_ids")
            _in_vocab("prompt_logprob_token_ids", [t for t in row if t != -1], vocab_size)
        changes["prompt_logprob_token_ids"] = tuple(tuple(r) for r in rows)
        if options.prompt_logprobs is None:
            changes["prompt_logprobs"] = 0
    if start is not None:
        if options.prompt_logprobs is None and rows is None:
            raise RequestError("prompt_logprob_start needs prompt_logprobs or prompt_logprob_token_ids",
                               "sampling_params.prompt_logprob_start")
        changes["prompt_logprob_start"] = start
    trace = sp.trace_decode_token_ids
    if trace is not None:
        if not trace:
            raise RequestError("trace_decode_token_ids must not be empty", "sampling_params.trace_decode_token_ids")
        _in_vocab("trace_decode_token_ids", trace, vocab_size)
        trace = trace[:max(max_model_len - prompt_len, 1)]
        changes.update(trace_decode_token_ids=tuple(trace), max_tokens=min(len(trace), options.max_tokens),
                       min_tokens=0, ignore_eos=True, stop_token_ids=frozenset())
    return dataclasses.replace(options, **changes) if changes else options


def _in_vocab(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token_id(s) {bad[:8]} in {name} contain out-of-vocab token ids. Vocabulary size: "
                           f"{vocab_size}", f"sampling_params.{name}")


def forced_token(options: SamplingOptions, num_output_tokens: int) -> int | None:
    trace = options.trace_decode_token_ids
    if trace is None or num_output_tokens >= len(trace):
        return None
    return trace[num_output_tokens]


def prompt_entries(options: SamplingOptions, first: int, log_probs: torch.Tensor, targets: torch.Tensor,
                   k: int) -> list[TokenLogprob | None]:
    """Prompt logprob entries for rows first.. (row r predicts prompt token r + 1), with the controls applied."""
    entries: list[TokenLogprob | None] = list(logprobs_of(log_probs, targets, k))
    start = options.prompt_logprob_start or 0
    rows = options.prompt_logprob_token_ids
    for offset, entry in enumerate(entries):
        row = first + offset
        if row < start:
            entries[offset] = None
        elif rows is not None and entry is not None:
            ids = rows[row - start] if row - start < len(rows) else ()
            entries[offset] = with_token_ids(entry, log_probs[offset], ids)
    return entries
