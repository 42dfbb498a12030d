"""Stall-free chunked prefill: how many tokens a step may take so that decode streams keep their pace.

A step's time grows with its tokens (a fixed part for the weights read once, plus a part per token) and with
the context its prefill tokens attend to (a chunk late in a 32k prompt costs more than the same chunk early
in it). While sequences are decoding, each step is one inter-token gap for all of them, so a long prefill
chunk in the same step stalls every stream (Sarathi-Serve's observation). `StepTimeModel` fits step time
against the step's tokens and its prefill attention pairs from the steps the engine actually ran;
`PrefillPolicy.target_step_ms` turns that into a token budget per step for the context the next chunk
extends, and prefill chunks fill what the decode tokens leave. Where mixed steps replay CUDA graphs the engine
measures each bucket's replay at start-up instead, and `BucketStepTimes` plans from that table plus what real
steps add to a replay.

`PrefillPolicy` also carries vLLM 0.34's scheduler knobs for long prompts, with vLLM's meaning:
long_prefill_token_threshold (cap on one prompt's chunk, skipped when it is the only request),
long_prefill_token_threshold_adaptive (the cap never falls below the budget's fair share),
max_num_inflight_kv_loads (requests holding blocks for an asynchronous KV load), and
cache_aware_admission_window/threshold (within the first N waiting, prompts with a cached prefix first, once
the cache is at least that full).
"""

from __future__ import annotations

from dataclasses import dataclass

# The long context a bucket's step time is measured at (BucketStepTimes; engine start-up): long enough that the
# chunk's attention over it stands out of the replay's noise, short of the prompts a step budget is for.
STEP_TIME_CONTEXT = 16384


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


def attention_pairs(new_tokens: int, context: int) -> float:
    """Query-key pairs (millions) of a prefill chunk of `new_tokens` after `context` tokens: each new token
    attends to the context and, causally, to the chunk's tokens before it."""
    return new_tokens * (context + new_tokens / 2) / 1e6


class StepTimeModel:
    """step_ms ~ base_ms + per_token_ms * tokens + per_pair_ms * pairs (prefill attention, millions of
    query-key pairs): an exponentially weighted least-squares fit. Until the steps seen tell the pairs' part
    apart from the tokens' (prefills over different contexts), the pairs' part is 0 and the fit is linear in
    tokens."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        # weighted sums of 1, x, z, y, x*x, x*z, z*z, x*y, z*y (x: tokens, z: pairs, y: ms)
        self.n = self.sx = self.sz = self.sy = self.sxx = self.sxz = self.szz = self.sxy = self.szy = 0.0

    def observe(self, tokens: int, ms: float, pairs: float = 0.0) -> None:
        d = self.decay
        x, z, y = float(tokens), pairs, ms
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + x
        self.sz = self.sz * d + z
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxz = self.sxz * d + x * z
        self.szz = self.szz * d + z * z
        self.sxy = self.sxy * d + x * y
        self.szy = self.szy * d + z * y

    def fit(self) -> tuple[float, float] | None:
        """(base_ms, per_token_ms) of the fit linear in tokens, or None until steps of different sizes were
        seen."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or var <= 1e-9 * max(1.0, self.sxx * self.n):
            return None
        slope = (self.n * self.sxy - self.sx * self.sy) / var
        base = (self.sy - slope * self.sx) / self.n
        if slope <= 0:
            return None
        return max(0.0, base), slope

    def fit_with_pairs(self) -> tuple[float, float, float] | None:
        """(base_ms, per_token_ms, per_pair_ms); the pairs' part 0 where the steps seen cannot tell it apart
        (or it comes out negative). None until steps of different sizes were seen."""
        linear = self.fit()
        if linear is None:
            return None
        # Centred normal equations for (per_token, per_pair): [[Cxx, Cxz], [Cxz, Czz]] b = [Cxy, Czy].
        n = self.n
        cxx = self.sxx - self.sx * self.sx / n
        cxz = self.sxz - self.sx * self.sz / n
        czz = self.szz - self.sz * self.sz / n
        cxy = self.sxy - self.sx * self.sy / n
        czy = self.szy - self.sz * self.sy / n
        det = cxx * czz - cxz * cxz
        if czz <= 1e-12 or det <= 1e-9 * max(1e-12, cxx * czz):
            return (*linear, 0.0)
        per_token = (czz * cxy - cxz * czy) / det
        per_pair = (cxx * czy - cxz * cxy) / det
        if per_token <= 0 or per_pair < 0:
            return (*linear, 0.0)
        base = (self.sy - per_token * self.sx - per_pair * self.sz) / n
        return max(0.0, base), per_token, per_pair

    def tokens_for(self, target_ms: float, decode_tokens: int = 0, context: int = 0) -> int | None:
        """Tokens a step may take to last about target_ms: `decode_tokens` decode rows plus prefill tokens that
        extend a prompt whose first `context` tokens are computed. None while the model knows too little."""
        fitted = self.fit_with_pairs()
        if fitted is None:
            return None
        base, per_token, per_pair = fitted
        room = target_ms - base - per_token * decode_tokens
        if room <= 0:
            return decode_tokens
        # room = per_token * p + per_pair * p * (context + p / 2) / 1e6, solved for the prefill tokens p
        a = per_pair / 2e6
        b = per_token + per_pair * context / 1e6
        prefill = room / b if a <= 0 else (-b + (b * b + 4 * a * room) ** 0.5) / (2 * a)
        return decode_tokens + max(0, int(prefill))


class BucketStepTimes:
    """Step time of a graphed mixed step, per token bucket: what start-up measured replaying each bucket's graph
    with one prefill chunk at context 0 and at a long context (linear in between: the chunk's attention grows
    with the context it extends), plus what a real step adds to a bare replay (the host's part, the decode rows'
    attention), learned from the graphed steps that ran as a weighted mean of the difference. A step budget
    planned from these does not have to tell apart a step's tokens from its context in steps that vary both,
    as StepTimeModel must, and its first budgeted step is already sized for the card."""

    def __init__(self, measured: dict[int, tuple[float, float]], weight: float = 0.25,
                 first_margin: float = 0.25):
        self.measured = dict(sorted(measured.items()))
        self.weight = weight
        self.first_margin = first_margin  # of the target, kept free until a real step has been seen
        self.extra_ms: float | None = None

    def replay_ms(self, bucket: int, context: int) -> float:
        base, per_thousand = self.measured[bucket]
        return base + per_thousand * context / 1e3

    def observe(self, tokens: int, context: int, ms: float) -> None:
        """A step that ran `tokens` rows (a bucket's, if it replayed a graph) with a prefill chunk over `context`."""
        if tokens not in self.measured:
            return
        extra = ms - self.replay_ms(tokens, context)
        self.extra_ms = extra if self.extra_ms is None else self.extra_ms + self.weight * (extra - self.extra_ms)

    def tokens_for(self, target_ms: float, context: int, floor: int) -> int:
        """Tokens for a step whose prefill extends `context`: the largest bucket's (less the padding row a graph
        keeps) expected within target_ms; at least `floor`, then the smallest bucket that holds it."""
        extra = self.extra_ms if self.extra_ms is not None else self.first_margin * target_ms
        fitting = [b - 1 for b in self.measured if self.replay_ms(b, context) + extra <= target_ms]
        return fill_bucket(max(fitting, default=0), floor, tuple(self.measured))
