"""The request budget and its allocation among chunks (pure functions: no model)."""

import pytest
import torch

from cachetune.methods.allocation import (
    allocate,
    equal_quotas,
    global_top,
    proportional_quotas,
    request_budget,
    starts,
    weighted_quotas,
)


def positions(lengths):
    """Scores of the `first` ranking: earlier tokens first (not comparable across chunks)."""
    return [torch.arange(n, 0, -1, dtype=torch.float32) for n in lengths]


def total(selection):
    return sum(int(s.numel()) for s in selection)


def test_request_budget_is_rounded_share_of_all_chunk_tokens():
    assert request_budget([100, 20, 30], 0.15) == 23  # 22.5 rounds up
    assert request_budget([10, 10], 0.0) == 0
    assert request_budget([10, 10], 1.0) == 20
    with pytest.raises(ValueError):
        request_budget([10], 1.5)


@pytest.mark.parametrize("lengths,budget", [([100, 20, 30], 22), ([7, 7, 7], 10), ([1, 50, 3], 54), ([5], 0)])
def test_quotas_sum_to_the_budget_and_fit_their_chunks(lengths, budget):
    for quotas in (proportional_quotas(lengths, budget), equal_quotas(lengths, budget)):
        assert sum(quotas) == budget
        assert all(0 <= q <= n for q, n in zip(quotas, lengths))


def test_proportional_follows_lengths_and_equal_does_not():
    assert proportional_quotas([100, 20, 30], 15) == [10, 2, 3]
    assert equal_quotas([100, 20, 30], 15) == [5, 5, 5]


def test_equal_water_fills_short_chunks():
    # A 3-token chunk cannot take a third of 30: it keeps all 3, the others share the rest.
    assert equal_quotas([100, 3, 100], 30) == [14, 3, 13]


def test_every_allocation_spends_exactly_the_request_budget():
    lengths = [120, 35, 600, 8]
    offline = positions(lengths)
    online = [torch.rand(n, generator=torch.Generator().manual_seed(n)) for n in lengths]
    budget = request_budget(lengths, 0.15)
    for allocation in ("proportional", "spread"):
        assert total(allocate(offline, 0.15, allocation)) == budget
    for allocation in ("proportional", "spread", "focus"):
        picked = allocate(online, 0.15, allocation, comparable=True)
        assert total(picked) == budget
        for s, n in zip(picked, lengths):
            assert torch.equal(s, torch.unique(s)) and (s.numel() == 0 or (s[0] >= 0 and s[-1] < n))


def test_starts_are_the_same_first_tokens_of_every_chunk():
    assert [s.tolist() for s in starts(positions([40, 40, 40]), 6)] == [[0, 1], [0, 1], [0, 1]]
    assert [s.numel() for s in starts(positions([3, 40]), 30)] == [3, 27]  # a short chunk gives the rest away


def test_starts_follow_the_offline_ranking_and_the_signal_takes_the_rest():
    ranked = [torch.tensor([0.0, 5.0, 1.0, 0.0]), torch.tensor([3.0, 0.0, 0.0, 9.0])]
    online = [torch.tensor([9.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.1, 0.0])]
    picked = allocate(online, 0.5, "spread", comparable=True, start_share=0.5, ranked=ranked)
    # budget 4: two on starts (each chunk's top-ranked token: 1 and 3), two by the signal (0 and 2)
    assert [s.tolist() for s in picked] == [[0, 1], [2, 3]]


def test_proportional_on_first_is_the_first_tokens_of_each_chunk():
    picked = allocate(positions([100, 20]), 0.25, "proportional")
    assert picked[0].tolist() == list(range(25)) and picked[1].tolist() == list(range(5))


def test_focus_needs_comparable_scores_and_rejected_allocations_are_unknown():
    with pytest.raises(ValueError, match="compare across chunks"):
        allocate(positions([10, 10]), 0.5, "focus")
    for gone in ("sideways", "equal", "starts", "global"):
        with pytest.raises(ValueError, match="unknown allocation"):
            allocate(positions([10]), 0.5, gone)


def test_global_top_takes_the_top_of_the_whole_context_after_what_is_taken():
    scores = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.05, 0.7])]
    assert [s.tolist() for s in global_top(scores, 3)] == [[1], [0, 2]]
    taken = [torch.tensor([1]), torch.empty(0, dtype=torch.int64)]
    assert [s.tolist() for s in global_top(scores, 2, taken=taken)] == [[1], [0, 2]]


def test_spread_keeps_the_signal_inside_each_chunk_in_proportion_to_its_length():
    scores = [torch.zeros(40), torch.zeros(40)]
    scores[1][30] = 5.0
    scores[1][31] = 4.0
    picked = allocate(scores, 0.25, "spread", comparable=True, start_share=0.5)
    # budget 20: 10 on starts (5 each), the other 10 split 5 / 5 whatever the signal prefers
    assert [s.numel() for s in picked] == [10, 10]
    assert {30, 31} <= set(picked[1].tolist()) and picked[1].tolist()[:5] == [0, 1, 2, 3, 4]


def test_signal_tokens_cap_the_signal_picks_per_chunk_and_the_rest_continues_the_starts():
    scores = [torch.zeros(40), torch.zeros(40)]
    scores[0][20:23] = torch.tensor([3.0, 2.0, 1.0])
    scores[1][30:33] = torch.tensor([3.0, 2.0, 1.0])
    # budget 20: 10 on starts (5 each), 5 more per chunk, of which at most 2 by the signal
    picked = allocate(scores, 0.25, "spread", comparable=True, start_share=0.5, signal_tokens=2)
    assert picked[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 20, 21]
    assert picked[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 30, 31]
    uncapped = allocate(scores, 0.25, "spread", comparable=True, start_share=0.5, signal_tokens=100)
    assert [s.tolist() for s in uncapped] == [s.tolist() for s in allocate(scores, 0.25, "spread", comparable=True,
                                                                            start_share=0.5)]
    assert [s.tolist() for s in allocate(scores, 0.25, "spread", comparable=True, start_share=0.5, signal_tokens=0)] \
        == [list(range(10))] * 2  # no signal picks: each chunk's first tokens, `first` at the same budget
    with pytest.raises(ValueError, match="signal_tokens"):
        allocate(scores, 0.25, "spread", comparable=True, signal_tokens=-1)


def test_weighted_quotas_follow_the_weights_within_each_cap():
    assert weighted_quotas([3.0, 1.0], [100, 100], 40) == [30, 10]
    # the first chunk can take 5 only: the rest goes to the others by their weights
    assert weighted_quotas([10.0, 1.0, 3.0], [5, 100, 100], 25) == [5, 5, 15]
    assert weighted_quotas([0.0, 0.0], [30, 10], 8) == [6, 2]  # no weight anywhere: by the caps
    assert sum(weighted_quotas([1.0, 1.0, 1.0], [4, 4, 4], 2)) == 2
    assert weighted_quotas([1.0, 2.0], [3, 3], 6) == [3, 3]
    with pytest.raises(ValueError, match="budget"):
        weighted_quotas([1.0], [3], 4)


def test_focus_shares_the_rest_by_where_the_signal_falls_and_keeps_the_starts():
    scores = [torch.full((40,), 0.001), torch.full((40,), 0.001)]
    scores[1][30] = 1.0  # the question looks at the second chunk
    picked = allocate(scores, 0.25, "focus", comparable=True, start_share=0.5, signal_tokens=0)
    # budget 20: 10 on starts (5 each); the other 10 go almost all to the second chunk, as its next
    # first tokens (signal_tokens=0: no signal picks inside it)
    assert picked[0].tolist() == [0, 1, 2, 3, 4]
    assert picked[1].tolist() == list(range(15))
    with_picks = allocate(scores, 0.25, "focus", comparable=True, start_share=0.5, signal_tokens=2)
    assert 30 in with_picks[1].tolist() and with_picks[1].tolist()[:13] == list(range(13))
    with pytest.raises(ValueError, match="compare across chunks"):
        allocate(positions([10, 10]), 0.5, "focus")
