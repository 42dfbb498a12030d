"""Sampler: each knob on hand-made logits, vectorized over rows with different settings."""

from __future__ import annotations

import math

import pytest
import torch

from token_engine.core.sampler import Sampler, SamplingRow
from token_engine.core.sequence import SamplingOptions

V = 8


def row(prompt=(), output=(), generator_seed=None, blocked=frozenset(), **opts) -> SamplingRow:
    options = SamplingOptions(**opts)
    gen = None
    if generator_seed is not None:
        gen = torch.Generator().manual_seed(generator_seed)
    return SamplingRow(options, list(prompt), list(output), gen, frozenset(blocked))


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.0, 3.0, 2.5, 1.0, -1.0, 0.5, 2.9, -2.0]  # best 1, then 6, then 2


def test_greedy_takes_the_argmax():
    tokens, _ = Sampler()(logits_of(BASE), [row(temperature=0.0)])
    assert tokens == [1]


def test_top_k_one_and_tiny_top_p_behave_like_greedy_at_any_temperature():
    sampler = Sampler(seed=1)
    for _ in range(20):
        tokens, _ = sampler(logits_of(BASE, BASE), [row(temperature=5.0, top_k=1), row(temperature=5.0, top_p=1e-6)])
        assert tokens == [1, 1]


def test_top_k_limits_the_candidates():
    sampler = Sampler(seed=2)
    seen = set()
    for _ in range(200):
        tokens, _ = sampler(logits_of(BASE), [row(temperature=10.0, top_k=3)])
        seen.add(tokens[0])
    assert seen == {1, 6, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor(BASE).softmax(0)
    order = probs.argsort(descending=True).tolist()
    # top_p just above p(best) + p(second) keeps exactly three candidates.
    p = float(probs[order[0]] + probs[order[1]]) + 1e-4
    sampler = Sampler(seed=3)
    seen = {sampler(logits_of(BASE), [row(top_p=p)])[0][0] for _ in range(300)}
    assert seen == set(order[:3])


def test_min_p_drops_tokens_far_below_the_best():
    sampler = Sampler(seed=4)
    seen = {sampler(logits_of(BASE), [row(min_p=0.5)])[0][0] for _ in range(300)}
    # p(x)/p(best) >= 0.5 <=> logit >= 3.0 - ln 2
    assert seen == {i for i, v in enumerate(BASE) if v >= 3.0 - math.log(2)}


def test_sampling_frequencies_follow_the_softmax():
    sampler = Sampler(seed=5)
    n = 4000
    counts = torch.zeros(V)
    logits = logits_of(*([BASE] * 100))
    for _ in range(n // 100):
        tokens, _ = sampler(logits, [row() for _ in range(100)])
        counts += torch.bincount(torch.tensor(tokens), minlength=V)
    expected = torch.tensor(BASE).softmax(0) * n
    # With a fixed seed this is deterministic; the bound is ~5 standard deviations for the largest bucket.
    assert torch.all((counts - expected).abs() <= 5 * expected.sqrt() + 5)


def test_temperature_sharpens_and_flattens():
    sampler = Sampler(seed=6)
    cold = [sampler(logits_of(BASE), [row(temperature=0.005)])[0][0] for _ in range(100)]
    hot = [sampler(logits_of(BASE), [row(temperature=50.0)])[0][0] for _ in range(300)]
    assert set(cold) == {1}
    assert len(set(hot)) >= 7


def test_seeded_rows_repeat_and_do_not_depend_on_their_neighbours():
    def seeded_run(neighbours: int, seed_row_position: int):
        gen_row = row(temperature=2.0, generator_seed=1234)
        rows = [row(temperature=2.0) for _ in range(neighbours)]
        rows.insert(seed_row_position, gen_row)
        sampler = Sampler(seed=neighbours)  # unseeded neighbours draw from a different stream each time
        logits = logits_of(*([BASE] * len(rows)))
        return [sampler(logits, rows)[0][seed_row_position] for _ in range(30)]

    alone = seeded_run(0, 0)
    assert seeded_run(3, 2) == alone
    assert seeded_run(5, 0) == alone
    assert len(set(alone)) > 1


def test_repetition_penalty_covers_prompt_and_output_tokens():
    # Token 1 (logit 3.0) seen in the prompt: divided by 2 -> 1.5, below token 6 (2.9).
    tokens, _ = Sampler()(logits_of(BASE, BASE), [row(prompt=[1], temperature=0.0, repetition_penalty=2.0),
                                                 row(output=[1], temperature=0.0, repetition_penalty=2.0)])
    assert tokens == [6, 6]
    # A negative logit is multiplied instead: token 4 goes from -1 to -2, so still not chosen; the argmax is unchanged.
    tokens, _ = Sampler()(logits_of(BASE), [row(prompt=[4], temperature=0.0, repetition_penalty=2.0)])
    assert tokens == [1]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    sampler = Sampler()
    tokens, _ = sampler(logits_of(BASE, BASE, BASE), [
        row(prompt=[1, 1, 1], temperature=0.0, frequency_penalty=1.0),  # prompt does not count
        row(output=[1], temperature=0.0, presence_penalty=0.2),  # 3.0 - 0.2 < 2.9
        row(output=[1, 1], temperature=0.0, frequency_penalty=0.3),  # 3.0 - 0.6 < 2.9 and < ... 2.5 -> 6
    ])
    assert tokens == [1, 6, 6]


def test_blocked_ids_are_never_sampled():
    tokens, _ = Sampler()(logits_of(BASE), [row(temperature=0.0, blocked={1, 6})])
    assert tokens == [2]


def test_banned_bad_word_tokens_are_never_sampled_in_their_row_only_and_logprobs_stay_raw():
    sampler = Sampler(seed=4)
    banning = SamplingRow(SamplingOptions(temperature=0.0, logprobs=0), [], [], None, frozenset(), banned=(1, 6))
    tokens, lps = sampler(logits_of(BASE, BASE), [banning, row(temperature=0.0)])
    assert tokens == [2, 1]
    assert lps[0].logprob == pytest.approx(float(torch.tensor(BASE).log_softmax(0)[2]))
    hot = SamplingRow(SamplingOptions(temperature=5.0), [], [], None, frozenset(), banned=(1, 6, 2))
    assert all(sampler(logits_of(BASE), [hot])[0][0] not in (1, 6, 2) for _ in range(200))


def test_logit_bias_and_allowed_token_ids():
    sampler = Sampler()
    tokens, _ = sampler(logits_of(BASE, BASE), [row(temperature=0.0, logit_bias=((7, 10.0),)),
                                                row(temperature=0.0, allowed_token_ids=(3, 4))])
    assert tokens == [7, 3]


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    sampler = Sampler()
    tokens, lps = sampler(logits_of(BASE, BASE), [row(temperature=0.0, logprobs=3, repetition_penalty=2.0,
                                                      prompt=[1]),
                                                  row(temperature=0.0)])
    assert lps[1] is None
    entry = lps[0]
    raw = torch.tensor(BASE).log_softmax(0)
    assert entry.token_id == tokens[0] == 6  # the penalty changed the choice...
    assert entry.logprob == pytest.approx(float(raw[6]))  # ...but logprobs are the model's, unprocessed
    assert entry.rank == 2
    assert [t for t, _ in entry.top] == [1, 6, 2]
    assert [lp for _, lp in entry.top] == pytest.approx([float(raw[1]), float(raw[6]), float(raw[2])])


def test_zero_logprobs_returns_only_the_sampled_token():
    _, lps = Sampler()(logits_of(BASE), [row(temperature=0.0, logprobs=0)])
    assert lps[0].token_id == 1 and lps[0].rank == 1 and lps[0].top == []


def test_mixed_batch_applies_each_rows_own_settings():
    sampler = Sampler(seed=7)
    rows = [row(temperature=0.0), row(temperature=3.0, top_k=1), row(allowed_token_ids=(5,)),
            row(temperature=0.0, blocked={1})]
    for _ in range(10):
        tokens, _ = sampler(logits_of(*([BASE] * 4)), rows)
        assert tokens == [1, 1, 5, 6]
