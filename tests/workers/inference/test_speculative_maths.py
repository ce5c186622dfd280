"""The speculative acceptance rule and the n-gram proposer (workers/inference/speculative.py)
against hand-computed values, and a statistical check that speculative sampling's output follows
the target distribution p whatever the draft distribution q."""

from __future__ import annotations

import math

import pytest
import torch

from workers.inference.speculative import (
    accept_greedy,
    accept_sampled,
    prompt_lookup,
    residual,
)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_residual_is_the_normalised_positive_part_of_p_minus_q():
    # max(0, p - q) = [0.3, 0, 0.1, 0] -> / 0.4
    r = residual(torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.5, 0.1, 0.2]))
    assert torch.allclose(r, torch.tensor([0.75, 0.0, 0.25, 0.0]))
    p = torch.tensor([0.25, 0.75])
    assert torch.equal(residual(p, p.clone()), p)  # nothing left: p itself


def test_drafts_the_target_likes_at_least_as_much_are_all_kept_then_a_bonus_from_p_k():
    draft = [0, 2]
    q = t([0.5, 0.5, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0])
    p = t([0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0])  # p >= q at 0, 2
    for seed in range(5):
        assert accept_sampled(draft, q, p, torch.Generator().manual_seed(seed)) == ([0, 2, 3], 2)


def test_a_draft_the_target_never_picks_is_rejected_and_resampled_from_the_residual():
    draft = [0, 2]
    q = t([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0])
    p = t([0.7, 0.3, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25])
    # Position 0: p/q = 0.7 at token 0, rejected when u >= 0.7 (then the residual [0,1,0,0]
    # gives token 1). Position 1: p(2) = 0 always rejects; the residual is [0,1,0,0].
    for seed in range(20):
        u = float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
        got = accept_sampled(draft, q, p, torch.Generator().manual_seed(seed))
        assert got == (([0, 1], 1) if u < 0.7 else ([1], 0))


def test_no_drafts_samples_one_token_from_p():
    p = t([0.0, 0.0, 1.0])
    assert accept_sampled([], torch.zeros((0, 3)), p, torch.Generator()) == ([2], 0)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="2 drafts need q of 2 rows and p of 3"):
        accept_sampled([0, 1], t([1.0, 0.0]), t([1.0, 0.0], [1.0, 0.0]), torch.Generator())
    with pytest.raises(ValueError, match="2 drafts need 3 target choices"):
        accept_greedy([0, 1], [0, 1])


def test_greedy_keeps_drafts_while_they_match_the_argmax():
    assert accept_greedy([3, 1, 2], [3, 1, 0, 5]) == ([3, 1, 0], 2)
    assert accept_greedy([3, 1], [3, 1, 7]) == ([3, 1, 7], 2)
    assert accept_greedy([4], [3, 9]) == ([3], 0)
    assert accept_greedy([], [6]) == ([6], 0)


def test_speculative_sampling_output_follows_p_whatever_q():
    """Two drafts from q (far from p) on a 4-token vocabulary, 20000 steps: the first emitted
    token must follow p0, and the second (emitted when the first draft was kept) p1. Each
    frequency is checked within 5 standard errors of a binomial proportion at its own count
    (a false failure has odds below 1e-6 per cell)."""
    p = t([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25])
    q = t([0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7])
    gen = torch.Generator().manual_seed(1234)
    draws = 20000
    drafts = torch.stack([torch.multinomial(q[i], draws, replacement=True, generator=gen)
                          for i in range(2)], dim=1).tolist()
    first = [0] * 4
    second = [0] * 4
    for d in drafts:
        out, _ = accept_sampled(d, q, p, gen)
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1

    def check(counts: list[int], probs: torch.Tensor) -> None:
        n = sum(counts)
        for c, pr in zip(counts, probs.tolist(), strict=True):
            se = math.sqrt(pr * (1 - pr) / n)
            assert abs(c / n - pr) <= 5 * se, (counts, probs)

    check(first, p[0])
    assert sum(second) > 1000  # the first draft is kept often enough to test the second
    check(second, p[1])


def test_prompt_lookup_proposes_what_followed_the_latest_full_earlier_match():
    assert prompt_lookup([1, 2, 3, 4, 1, 2], n=2, k=3) == [3, 4, 1]
    assert prompt_lookup([5, 6, 9, 5, 6, 7, 5, 6], n=2, k=2) == [7, 5]  # latest match wins
    assert prompt_lookup([5, 6, 9, 5, 6, 7, 5, 6], n=3, k=2) == []  # "7 5 6" never earlier
    assert prompt_lookup([7, 7, 7], n=2, k=4) == [7]  # overlapping match, cut by the end
    # In a repeating tail the latest match leaves 2 tokens; the earlier one gives all 3.
    assert prompt_lookup([1, 2, 1, 2, 1, 2], n=2, k=3) == [1, 2, 1]
    assert prompt_lookup([1, 2, 1, 2, 1, 2], n=2, k=2) == [1, 2]
    assert prompt_lookup([1, 2], n=2, k=3) == []  # nothing before the tail
    assert prompt_lookup([3, 1, 3], n=1, k=1) == [1]
    with pytest.raises(ValueError, match="n and k must be >= 1"):
        prompt_lookup([1, 2, 3], n=0, k=2)
