"""Stall-free chunked prefill: how many tokens a step may take so that decode streams keep their pace.

A step's time grows with its tokens (a fixed part for the weights read once, plus a part per token). While
sequences are decoding, each step is one inter-token gap for all of them, so a long prefill chunk in the
same step stalls every stream (Sarathi-Serve's observation). `StepTimeModel` fits step time against the
step's tokens from the steps the engine actually ran; `PrefillPolicy.target_step_ms` turns that into a
token budget per step, and prefill chunks fill what the decode tokens leave.

`PrefillPolicy` also carries vLLM 0.34's scheduler knobs for long prompts, with vLLM's meaning:
long_prefill_token_threshold (cap on one prompt's chunk, skipped when it is the only request),
long_prefill_token_threshold_adaptive (the cap never falls below the budget's fair share),
max_num_inflight_kv_loads (requests holding blocks for an asynchronous KV load), and
cache_aware_admission_window/threshold (within the first N waiting, prompts with a cached prefix first, once
the cache is at least that full).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillPolicy:
    target_step_ms: float = 0.0  # 0: off; else the step budget keeps steps near this while sequences decode
    min_prefill_tokens: int = 64  # a prefill always gets at least this much of a budgeted step
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    max_num_inflight_kv_loads: int | None = None
    cache_aware_admission_window: int = 0
    cache_aware_admission_threshold: float = 0.5

    def chunk_cap(self, budget: int, num_requests: int) -> int:
        """Most tokens one prefill may take this step (0: no cap)."""
        cap = self.long_prefill_token_threshold
        if cap <= 0 or num_requests <= 1:
            return 0
        if self.long_prefill_token_threshold_adaptive:
            cap = max(cap, budget // num_requests)
        return cap


def fill_bucket(tokens: int, floor: int, buckets: tuple[int, ...]) -> int:
    """Tokens for a step the runner pads up to a bucket (a graph needs one padded row past the real ones): the
    largest bucket's worth within `tokens`, since a padded step costs its whole bucket; at least `floor`."""
    within = [b - 1 for b in buckets if b - 1 <= tokens]
    best = max(within) if within else tokens
    if best < floor:
        above = [b - 1 for b in buckets if b - 1 >= floor]
        best = min(above) if above else floor
    return best


class StepTimeModel:
    """step_ms ~ base_ms + per_token_ms * tokens, an exponentially weighted least-squares fit."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + tokens
        self.sy = self.sy * d + ms
        self.sxx = self.sxx * d + tokens * tokens
        self.sxy = self.sxy * d + tokens * ms

    def fit(self) -> tuple[float, float] | None:
        """(base_ms, per_token_ms), or None until steps of different sizes were seen."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or var <= 1e-9 * max(1.0, self.sxx * self.n):
            return None
        slope = (self.n * self.sxy - self.sx * self.sy) / var
        base = (self.sy - slope * self.sx) / self.n
        if slope <= 0:
            return None
        return max(0.0, base), slope

    def tokens_for(self, target_ms: float) -> int | None:
        """Tokens a step may take to last about target_ms; None while the model knows too little."""
        fitted = self.fit()
        if fitted is None:
            return None
        base, slope = fitted
        return max(0, int((target_ms - base) / slope))
