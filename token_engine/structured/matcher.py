"""Per-sequence grammar state and the allowed-token mask it puts on the logits.

A GrammarState advances exactly once per output token appended to its sequence (Sequence.append_token),
never when logits are recomputed: preemption by recompute re-runs the model over tokens the grammar has
already accepted, so the state needs no rollback. The mask is built on the host (xgrammar fills a packed
int32 bitmask) and expanded on the logits' device with plain torch ops, so it works on CPU and CUDA alike.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

_BITS = 32


class GrammarState:
    def __init__(self, compiled_grammar: Any, stop_token_ids: Iterable[int]):
        import xgrammar

        stops = sorted(set(stop_token_ids))
        # The grammar may end only on one of the request's own stop tokens; with none (ignore_eos and no
        # stop_token_ids) it ends by itself when complete.
        self._matcher = xgrammar.GrammarMatcher(compiled_grammar, override_stop_tokens=stops or None,
                                                terminate_without_stop_token=not stops)
        self.num_accepted = 0
        self.violated = False  # a sampled token the grammar refused (another mask left nothing it allows)

    def accept(self, token_id: int) -> None:
        if self.violated or self._matcher.is_terminated():
            self.violated = True
            return
        if self._matcher.accept_token(token_id):
            self.num_accepted += 1
        else:
            self.violated = True

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars_(logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
    """Set to -inf, in place, every logit the row's grammar does not allow next (rows without one untouched)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), -(-vocab // _BITS)), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].fill_bitmask(bitmask, j)
    device = logits.device
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(_BITS, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    idx = torch.tensor(rows, device=device)
    logits[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
