"""One prefill for a GRPO group: the ``n`` samples of a request, and requests that repeat one prompt (duplicate
request ids from a trainer's group), compute the prompt's KV once.

A waiting sequence whose prompt another sequence is prefilling right now waits for that prefill to publish
its blocks (the scheduler publishes full computed blocks after every step) and then takes them from the prefix
cache, instead of computing the same KV alongside. Only while the other is still prefilling: one that finished,
was aborted or preempted holds nobody back.
"""

from __future__ import annotations

from token_engine.core.kv_cache import BlockManager
from token_engine.core.sequence import Sequence


def share_key(bm: BlockManager, seq: Sequence) -> bytes | None:
    """The hash of the last prompt block a follower could take from the cache (None: nothing to share)."""
    if not bm.enable_prefix_caching or seq.options.prompt_logprobs is not None or seq.options.skip_prefix_cache:
        return None
    shareable = (seq.prompt_len - 1) // bm.block_size  # the last prompt token always runs
    if shareable == 0:
        return None
    if len(seq.block_hashes) < shareable:
        bm.update_block_hashes(seq)
    return seq.block_hashes[shareable - 1]


def prefills_in_flight(bm: BlockManager, running: list[Sequence]) -> set[bytes]:
    keys = set()
    for seq in running:
        if seq.num_computed_tokens < seq.prompt_len:
            key = share_key(bm, seq)
            if key is not None:
                keys.add(key)
    return keys


def waits_for_group_prefill(bm: BlockManager, seq: Sequence, in_flight: set[bytes]) -> bool:
    """Whether fresh ``seq`` should wait a step for a sibling's prefill of the same prompt."""
    if not in_flight or seq.block_table:
        return False
    key = share_key(bm, seq)
    if key is None or key not in in_flight:
        return False
    cached = bm.find_cached_prefix(seq)  # already published up to the shareable end: go now
    return len(cached) < (seq.prompt_len - 1) // bm.block_size
