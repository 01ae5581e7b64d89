"""Offline low-frequency token ranking (lf_scores and helpers) and the chunk content address."""

import pytest
import torch

from cachetune.chunks.encode import chunk_id
from cachetune.chunks.ranking import (
    high_frequency,
    lf_scores,
    low_frequency,
    ranking_from_scores,
    top_share,
)
from cachetune.chunks.rankers import rank_tokens

FP = "a" * 64
FP_OTHER = "b" * 64


# --- low_frequency ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 64, 65])
def test_low_frequency_keeps_a_constant_signal_exactly(n) -> None:
    x = torch.full((n, 3, 2), 2.5)
    y = low_frequency(x, 0.5)
    assert y.shape == x.shape
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x, atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [2, 8, 64, 128])
def test_low_frequency_removes_an_alternating_signal_for_even_length(n) -> None:
    # (+1, -1, ...) with even N is the Nyquist frequency alone: the highest bin, dropped at alpha=0.5.
    x = torch.tensor([(-1.0) ** i for i in range(n)]).unsqueeze(1)
    y = low_frequency(x, 0.5)
    assert y.shape == x.shape
    torch.testing.assert_close(y, torch.zeros_like(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [63, 65, 129])
def test_low_frequency_removes_most_of_an_alternating_signal_for_odd_length(n) -> None:
    # With odd N the alternating signal is not periodic in N (it starts and ends with +1), so a little
    # energy leaks into low bins; the output keeps the input length and most of the energy is removed.
    x = torch.tensor([(-1.0) ** i for i in range(n)]).unsqueeze(1)
    y = low_frequency(x, 0.5)
    assert y.shape == x.shape
    assert y.norm() < 0.2 * x.norm()


@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 100, 101])
@pytest.mark.parametrize("alpha", [0.01, 0.5, 1.0])
def test_low_frequency_output_length_equals_input_length(n, alpha) -> None:
    x = torch.randn(n, 4)
    assert low_frequency(x, alpha).shape == (n, 4)


@pytest.mark.parametrize("n", [10, 11])
def test_low_frequency_with_alpha_one_is_identity(n) -> None:
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(low_frequency(x, 1.0), x, atol=1e-5, rtol=0)


def test_low_frequency_upcasts_bfloat16_to_float32() -> None:
    x = torch.randn(16, 3).bfloat16()
    assert low_frequency(x, 0.5).dtype == torch.float32


# --- lf_scores ------------------------------------------------------------------------------------------


def random_kv(layers=3, n=50, hkv=2, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, n, hkv, d, generator=gen)
    values = torch.randn(layers, n, hkv, d, generator=gen)
    return keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize("n", [1, 49, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lf_scores_returns_one_float32_score_per_token(n, dtype) -> None:
    keys, values = random_kv(n=n, dtype=dtype)
    scores = lf_scores(keys, values)
    assert scores.shape == (n,)
    assert scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    assert (scores >= 0).all()


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.0001, 2.0, float("nan")])
def test_lf_scores_rejects_alpha_outside_zero_one(alpha) -> None:
    keys, values = random_kv()
    with pytest.raises(ValueError, match="alpha"):
        lf_scores(keys, values, alpha)


@pytest.mark.parametrize("alpha", [1e-6, 0.25, 1.0])
def test_lf_scores_accepts_alpha_in_zero_one(alpha) -> None:
    keys, values = random_kv()
    assert lf_scores(keys, values, alpha).shape == (50,)


def test_lf_scores_rank_first_the_tokens_under_a_smooth_large_bump() -> None:
    layers, n, hkv, d, centre, width = 3, 128, 2, 8, 80, 6.0
    gen = torch.Generator().manual_seed(0)
    t = torch.arange(n, dtype=torch.float32)
    bump = 5.0 * torch.exp(-0.5 * ((t - centre) / width) ** 2)  # smooth, large
    direction = torch.randn(hkv, d, generator=gen)
    keys = 0.3 * torch.randn(layers, n, hkv, d, generator=gen) + bump[None, :, None, None] * direction
    values = 0.3 * torch.randn(layers, n, hkv, d, generator=gen) - bump[None, :, None, None] * direction
    ranking = ranking_from_scores(lf_scores(keys, values, 0.5))
    top = ranking[:12]
    assert ((top - centre).abs() <= 2 * width).all(), top.tolist()
    assert int(ranking[0]) in range(centre - 3, centre + 4)


def test_lf_scores_prefer_a_smooth_bump_over_high_frequency_energy_of_the_same_size() -> None:
    # Tokens 10..29 carry an alternating (high-frequency) pattern, tokens 80..99 a constant offset with
    # the same per-token magnitude. The low-pass keeps the second, so it ranks first.
    n, hkv, d = 128, 1, 4
    keys = torch.zeros(1, n, hkv, d)
    keys[0, 10:30] = torch.tensor([(-1.0) ** i for i in range(20)])[:, None, None] * 3.0
    keys[0, 80:100] = 3.0
    values = keys.clone()
    ranking = ranking_from_scores(lf_scores(keys, values, 0.25))
    assert set(ranking[:15].tolist()) <= set(range(75, 105))


def test_lf_scores_are_invariant_to_scaling_one_layers_keys_and_values() -> None:
    # Each layer is divided by its own sum, so multiplying all of one layer's K and V by a constant
    # leaves the scores unchanged.
    keys, values = random_kv(layers=3, n=64, seed=1)
    base = lf_scores(keys, values)
    keys2, values2 = keys.clone(), values.clone()
    keys2[1] *= 1000.0
    values2[1] *= 1000.0
    torch.testing.assert_close(lf_scores(keys2, values2), base, rtol=1e-5, atol=1e-8)
    keys3, values3 = keys.clone(), values.clone()
    keys3[0] *= 1e-3
    values3[0] *= 1e-3
    torch.testing.assert_close(lf_scores(keys3, values3), base, rtol=1e-5, atol=1e-8)


def test_lf_scores_weigh_layers_equally_and_sum_to_one() -> None:
    # Layer 0 peaks at token 20, layer 1 at token 100 with 1000x the magnitude: after per-layer
    # normalisation both peaks get the same score and the scores are a mean of distributions.
    n, d = 128, 4
    t = torch.arange(n, dtype=torch.float32)
    bump = lambda c: torch.exp(-0.5 * ((t - c) / 5.0) ** 2) + 0.01  # noqa: E731
    keys = torch.zeros(2, n, 1, d)
    keys[0] = bump(20)[:, None, None]
    keys[1] = 1000.0 * bump(100)[:, None, None]
    values = keys.clone()
    scores = lf_scores(keys, values, 1.0)
    assert float(scores.sum()) == pytest.approx(1.0, rel=1e-5)
    assert float(scores[20]) == pytest.approx(float(scores[100]), rel=1e-3)
    assert set(ranking_from_scores(scores)[:2].tolist()) == {20, 100}


def test_lf_scores_at_alpha_one_follow_each_tokens_magnitude() -> None:
    # alpha=1 keeps every frequency: a token whose K and V are c times another's scores c times as much.
    g = torch.Generator().manual_seed(2)
    direction = torch.randn(1, 2, 4, generator=g)
    scale = torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0])
    keys = (scale[:, None, None] * direction)[None]  # [1 layer, 5 tokens, 2 heads, 4 dims]
    scores = lf_scores(keys, keys.clone(), 1.0)
    torch.testing.assert_close(scores / scores[0], scale, rtol=1e-4, atol=1e-6)


# --- ranking_from_scores --------------------------------------------------------------------------------


def test_ranking_from_scores_is_a_permutation_highest_first() -> None:
    scores = torch.rand(200, generator=torch.Generator().manual_seed(3))
    ranking = ranking_from_scores(scores)
    assert ranking.dtype == torch.int64
    assert sorted(ranking.tolist()) == list(range(200))
    assert (scores[ranking][:-1] >= scores[ranking][1:]).all()


def test_ranking_from_scores_breaks_ties_by_earlier_token_first() -> None:
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 1.0, 2.0])
    assert ranking_from_scores(scores).tolist() == [1, 2, 4, 3, 6, 0, 5]


def test_ranking_from_scores_all_equal_is_identity() -> None:
    assert ranking_from_scores(torch.zeros(300)).tolist() == list(range(300))


# --- top_share -----------------------------------------------------------------------------------------


def test_top_share_returns_the_top_ranked_tokens_sorted() -> None:
    ranking = torch.randperm(100, generator=torch.Generator().manual_seed(4))
    sel = top_share(ranking, 0.15)
    assert sel.numel() == 15
    assert sel.tolist() == sorted(ranking[:15].tolist())


def test_top_share_zero_is_empty_and_one_is_everything() -> None:
    ranking = torch.randperm(37, generator=torch.Generator().manual_seed(5))
    assert top_share(ranking, 0.0).numel() == 0
    assert top_share(ranking, 1.0).tolist() == list(range(37))


@pytest.mark.parametrize("n, ratio, count", [(100, 0.15, 15), (10, 0.5, 5), (7, 0.3, 2), (7, 0.36, 3), (1, 0.4, 0)])
def test_top_share_count_is_ratio_times_n_rounded(n, ratio, count) -> None:
    assert top_share(torch.arange(n).flip(0), ratio).numel() == count


@pytest.mark.parametrize("ratio", [-0.01, 1.01, 2.0, float("nan")])
def test_top_share_rejects_ratio_outside_zero_one(ratio) -> None:
    with pytest.raises(ValueError, match="ratio"):
        top_share(torch.arange(10), ratio)


def test_top_share_of_empty_ranking_is_empty() -> None:
    assert top_share(torch.empty(0, dtype=torch.int64), 0.5).numel() == 0


# --- chunk_id ------------------------------------------------------------------------------------------


def test_chunk_id_equal_for_equal_inputs() -> None:
    ids = torch.tensor([5, 17, 2, 99])
    assert chunk_id(FP, ids) == chunk_id(FP, ids.clone())
    # The id addresses token values, not the tensor's integer dtype.
    assert chunk_id(FP, ids) == chunk_id(FP, ids.to(torch.int32))


def test_chunk_id_differs_for_different_fingerprints() -> None:
    ids = torch.tensor([5, 17, 2, 99])
    assert chunk_id(FP, ids) != chunk_id(FP_OTHER, ids)


@pytest.mark.parametrize(
    "other",
    [[5, 17, 2, 98], [17, 5, 2, 99], [5, 17, 2], [5, 17, 2, 99, 0], [0, 5, 17, 2, 99]],
    ids=["changed", "swapped", "shorter", "longer", "prefixed"],
)
def test_chunk_id_differs_for_different_token_ids(other) -> None:
    assert chunk_id(FP, torch.tensor([5, 17, 2, 99])) != chunk_id(FP, torch.tensor(other))


def test_chunk_id_is_a_hex_string_usable_as_file_name() -> None:
    cid = chunk_id(FP, torch.arange(10))
    assert len(cid) == 32
    assert int(cid, 16) >= 0  # raises if not hex


# ---- the analysis rankers ----------------------------------------------------------------------


def _kv(seed: int, n: int = 40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, 2, 8, generator=g), torch.randn(3, n, 2, 8, generator=g)


def test_high_frequency_is_exactly_what_low_frequency_removes():
    x = torch.randn(37, 5)
    assert torch.allclose(low_frequency(x, 0.3) + high_frequency(x, 0.3), x, atol=1e-5)


def test_l2_ranker_is_lf_without_a_filter():
    k, v = _kv(0)
    ids = torch.arange(40)
    assert torch.equal(rank_tokens("l2", k, v, ids), rank_tokens("lf", k, v, ids, alpha=1.0))
    assert not torch.equal(rank_tokens("l2", k, v, ids), rank_tokens("lf", k, v, ids, alpha=0.5))


def test_named_alpha_overrides_the_default():
    k, v = _kv(1)
    ids = torch.arange(40)
    assert torch.equal(rank_tokens("lf:0.3", k, v, ids), ranking_from_scores(lf_scores(k, v, 0.3)))
    assert torch.equal(rank_tokens("highfreq:0.3", k, v, ids), rank_tokens("highfreq", k, v, ids, alpha=0.3))
    with pytest.raises(ValueError, match="bad ranker 'lf:abc'"):
        rank_tokens("lf:abc", k, v, ids)
    with pytest.raises(ValueError, match="alpha must be in"):
        rank_tokens("lf:1.5", k, v, ids)
    with pytest.raises(ValueError, match="unknown ranker"):
        rank_tokens("nope", k, v, ids)


def test_random_ranking_is_a_permutation_fixed_by_the_chunk_content():
    k, v = _kv(2)
    ids = torch.arange(100, 140)
    a = rank_tokens("random", k, v, ids)
    assert torch.equal(torch.sort(a).values, torch.arange(40))
    assert torch.equal(a, rank_tokens("random", *_kv(3), ids))       # K/V play no part
    assert not torch.equal(a, rank_tokens("random", k, v, ids + 1))  # other content, other order
    assert torch.equal(rank_tokens("first", k, v, ids), torch.arange(40))
