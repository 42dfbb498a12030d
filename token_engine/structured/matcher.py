"""Per-sequence grammar state and the allowed-token mask it puts on the logits.

A GrammarState advances exactly once per output token appended to its sequence (Sequence.append_token),
never when logits are recomputed: preemption by recompute re-runs the model over tokens the grammar has
already accepted, so the state needs no rollback. The mask is built on the host (xgrammar fills a packed
int32 bitmask); xgrammar's CPU kernel applies it to CPU logits, plain torch ops on any other device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_BITS = 32


class GrammarState:
    def __init__(self, compiled_grammar: Any, stop_token_ids: Iterable[int], activate_after: int | None = None):
        import xgrammar

        stops = sorted(set(stop_token_ids))
        # The grammar may end only on one of the request's own stop tokens; with none (ignore_eos and no
        # stop_token_ids) it ends by itself when complete.
        self._matcher = xgrammar.GrammarMatcher(compiled_grammar, override_stop_tokens=stops or None,
                                                terminate_without_stop_token=not stops)
        self.num_seen = 0  # output tokens fed in, reasoning included
        self.violated = False  # a sampled token the grammar refused (another mask left nothing it allows)
        # As vLLM with a reasoning parser: while the model reasons nothing is constrained; the grammar starts
        # with the token after this one (</think>).
        self.waiting_for = activate_after

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token_id: int) -> None:
        self.num_seen += 1
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return
        if self.violated or self._matcher.is_terminated():
            self.violated = True
            return
        if not self._matcher.accept_token(token_id):
            self.violated = True

    @property
    def terminated(self) -> bool:
        return self.active and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars_(logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """Set to -inf, in place, every logit the row's grammar does not allow next (rows without one untouched)."""
    active = {i: g for i, g in enumerate(grammars) if g is not None and g.active}
    if not active:
        return
    rows = list(active)
    bitmask = torch.full((len(grammars), -(-logits.shape[1] // _BITS)), -1, dtype=torch.int32)  # -1: all allowed
    for i, grammar in active.items():
        grammar.fill_bitmask(bitmask, i)
    if logits.device.type == "cpu":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)  # its C++ kernel
    else:  # xgrammar's GPU kernels need nvcc or triton at run time: plain torch ops work on any device
        mask_by_bitmask_(logits, bitmask.to(logits.device, non_blocking=True))


def mask_by_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] where bit (v % 32) of bitmask[b, v // 32] is 0 become -inf; bitmask on logits' device."""
    shifts = torch.arange(_BITS, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
