"""sparse_causal_attention must equal plain dense causal attention, whatever subset of queries it gets.

plan_blocks (the per-prompt plan the layers share) must cover every query once, in order, with
unmasked blocks only over consecutive positions; how it groups queries is checked on constructed
inputs whose grouping its docstring promises.
"""

import random

import pytest
import torch

from cachetune.runtime.attention import MIN_RUN, QUERY_BLOCK, plan_blocks, sparse_causal_attention

HKV = 2
D = 16
SCALE = D**-0.5


def reference_attention(q, k, v, q_pos, scale, sliding_window=None):
    """Textbook attention in float64: repeat kv heads, scores, causal (and window) mask by position, softmax.

    q: [T, Hq, D], k/v: [N, Hkv, D]; query head h uses kv head h // (Hq // Hkv) (HF's repeat_kv order).
    Key j is visible to the query at position p iff j <= p and, with a window w, p - w < j.
    """
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)  # [N, Hq, D]
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,nhd->htn", q.double(), kk) * scale  # [Hq, T, N]
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), vv)  # [T, Hq, D]


def make_qkv(n, group, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HKV * group, D, generator=gen)
    k = torch.randn(n, HKV, D, generator=gen)
    v = torch.randn(n, HKV, D, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def scattered_positions(n, share, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n, generator=gen)[: int(share * n)]).values


def mixed_positions(n=700):
    """Scattered tokens, a long run, more scattered tokens, a run that ends at the last position."""
    pos = list(range(3, 150, 7)) + list(range(200, 261)) + list(range(263, 500, 5)) + list(range(520, n))
    return torch.tensor(sorted(set(pos)))


def position_sets(n=700):
    return {
        "all": torch.arange(n),
        "scattered_15pct": scattered_positions(n, 0.15),
        "mixed_runs_and_scattered": mixed_positions(n),
        "decode_last": torch.tensor([n - 1]),
        "first_only": torch.tensor([0]),
    }


def assert_matches_reference(q_full, k, v, q_pos, sliding_window=None, atol=1e-5):
    q = q_full[q_pos]
    out = sparse_causal_attention(q, k, v, q_pos, SCALE, sliding_window=sliding_window)
    ref = reference_attention(q, k, v, q_pos, SCALE, sliding_window)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


# --- equality with the dense causal reference --------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("kind", list(position_sets()))
def test_sparse_attention_matches_dense_causal_reference(kind, group) -> None:
    q, k, v = make_qkv(700, group)
    assert_matches_reference(q, k, v, position_sets()[kind])


def test_full_prefill_spans_several_blocks_and_matches_reference() -> None:
    n = 333  # > 2 * QUERY_BLOCK
    assert n > 2 * QUERY_BLOCK
    q, k, v = make_qkv(n, 2, seed=1)
    assert_matches_reference(q, k, v, torch.arange(n))


def blocks(pos):
    """plan_blocks as (start, stop, contiguous) triples: contiguous blocks are the ones without a mask."""
    plan = plan_blocks(torch.tensor(pos, dtype=torch.int64), 2, torch.float32)
    return [(b.start, b.stop, b.mask is None) for b in plan]


def test_mixed_positions_exercise_both_block_kinds() -> None:
    # Guard for the test above: the mixed pattern must produce contiguous and grouped blocks.
    flags = {contiguous for _, _, contiguous in blocks(mixed_positions().tolist())}
    assert flags == {True, False}


@pytest.mark.parametrize("group", [1, 3])
def test_a_plan_passed_in_gives_the_same_attention(group) -> None:
    # The forward builds one plan per prompt and hands it to every layer.
    q, k, v = make_qkv(700, group, seed=9)
    pos = mixed_positions()
    plan = plan_blocks(pos, group, q.dtype)
    out = sparse_causal_attention(q[pos], k, v, pos, SCALE, plan=plan)
    torch.testing.assert_close(out.double(), reference_attention(q[pos], k, v, pos, SCALE), atol=1e-5, rtol=0)


def test_many_short_runs_are_grouped_into_several_blocks_and_match_reference() -> None:
    # Runs of 3 every 5 positions: all short, so they are grouped; > QUERY_BLOCK of them -> several groups.
    pos = torch.tensor([p for start in range(0, 1000, 5) for p in range(start, start + 3)])
    assert len(blocks(pos.tolist())) > 1
    q, k, v = make_qkv(1000, 2, seed=2)
    assert_matches_reference(q, k, v, pos)


def test_decode_single_query_at_last_position_matches_reference() -> None:
    q, k, v = make_qkv(700, 3, seed=3)
    out = sparse_causal_attention(q[-1:], k, v, torch.tensor([699]), SCALE)
    ref = reference_attention(q[-1:], k, v, torch.tensor([699]), SCALE)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_query_sees_keys_up_to_and_including_its_own_position_only() -> None:
    # Changing keys/values after the last query position must not change the result.
    q, k, v = make_qkv(400, 2, seed=4)
    pos = scattered_positions(300, 0.2)
    out = sparse_causal_attention(q[pos], k, v, pos, SCALE)
    k2, v2 = k.clone(), v.clone()
    k2[300:] = 100.0
    v2[300:] = -100.0
    out2 = sparse_causal_attention(q[pos], k2, v2, pos, SCALE)
    torch.testing.assert_close(out, out2, atol=1e-6, rtol=0)


# --- sliding window -----------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 37, 128, 699])
@pytest.mark.parametrize("kind", ["all", "scattered_15pct", "mixed_runs_and_scattered", "decode_last"])
def test_sliding_window_matches_hf_convention(kind, window) -> None:
    # HF convention: key j is visible to the query at p iff p - window < j <= p.
    q, k, v = make_qkv(700, 2, seed=5)
    assert_matches_reference(q, k, v, position_sets()[kind], sliding_window=window)


@pytest.mark.parametrize("window", [700, 10_000])
def test_sliding_window_not_smaller_than_sequence_equals_plain_causal(window) -> None:
    q, k, v = make_qkv(700, 2, seed=6)
    pos = mixed_positions()
    with_window = sparse_causal_attention(q[pos], k, v, pos, SCALE, sliding_window=window)
    without = sparse_causal_attention(q[pos], k, v, pos, SCALE)
    torch.testing.assert_close(with_window, without, atol=1e-6, rtol=0)
    torch.testing.assert_close(with_window.double(), reference_attention(q[pos], k, v, pos, SCALE), atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 50])
def test_attention_on_an_accelerator_matches_reference(group, window) -> None:
    # Off the CPU every query set takes one masked kernel call; on the CPU a window shorter than the
    # keys does (window 50 above covers that path on the CPU).
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    q, k, v = make_qkv(500, group, seed=7)
    pos = scattered_positions(500, 0.3, seed=1)
    out = sparse_causal_attention(q[pos].cuda(), k.cuda(), v.cuda(), pos.cuda(), SCALE, sliding_window=window)
    assert out.device.type == "cuda"
    ref = reference_attention(q[pos], k, v, pos, SCALE, window)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=0)


# --- bfloat16 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["all", "scattered_15pct", "mixed_runs_and_scattered", "decode_last"])
def test_bfloat16_matches_reference_within_loose_tolerance(kind) -> None:
    q, k, v = make_qkv(700, 2, dtype=torch.bfloat16, seed=8)
    pos = position_sets()[kind]
    out = sparse_causal_attention(q[pos], k, v, pos, SCALE)
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q[pos], k, v, pos, SCALE)  # float64 on the bf16-rounded inputs
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)


# --- plan_blocks --------------------------------------------------------------------------------------------


def random_run_positions(seed):
    rng = random.Random(seed)
    pos, p = [], rng.randrange(5)
    while p < 3000:
        run = rng.choice([1, 1, 2, 5, QUERY_BLOCK // 4 - 1, QUERY_BLOCK // 4, 60, QUERY_BLOCK, 300])
        pos.extend(range(p, p + run))
        p += run + rng.randint(1, 20)
    return pos


def assert_blocks_partition(pos):
    expected_start = 0
    for start, stop, contiguous in blocks(pos):
        assert start == expected_start, "blocks must be in order with no gap or overlap"
        assert stop > start, "no empty blocks"
        if contiguous:
            assert pos[start:stop] == list(range(pos[start], pos[start] + (stop - start)))
        expected_start = stop
    assert expected_start == len(pos), "every query index must be covered"


@pytest.mark.parametrize("seed", range(20))
def test_blocks_cover_every_query_exactly_once_in_order_and_contiguous_flags_are_true(seed) -> None:
    assert_blocks_partition(random_run_positions(seed))


@pytest.mark.parametrize("seed", range(3))
def test_random_runs_and_gaps_match_reference(seed) -> None:
    pos = random_run_positions(seed)
    q, k, v = make_qkv(pos[-1] + 1, 2, seed=seed)
    assert_matches_reference(q, k, v, torch.tensor(pos))


@pytest.mark.parametrize(
    "pos",
    [
        [0],
        [5],
        list(range(700)),
        list(range(0, 700, 2)),
        mixed_positions().tolist(),
        scattered_positions(700, 0.15).tolist(),
    ],
    ids=["single_first", "single", "all", "every_other", "mixed", "scattered"],
)
def test_blocks_partition_on_typical_patterns(pos) -> None:
    assert_blocks_partition(pos)


def test_blocks_of_no_queries_is_empty() -> None:
    assert blocks([]) == []


def test_blocks_long_run_is_one_contiguous_block() -> None:
    pos = list(range(10, 10 + 3 * QUERY_BLOCK))
    assert blocks(pos) == [(0, len(pos), True)]


def test_blocks_flag_long_runs_between_scattered_tokens_as_contiguous() -> None:
    # A run longer than a scattered block may hold never joins one; a causal block takes no followers.
    run = list(range(100, 100 + 2 * QUERY_BLOCK))
    pos = [1, 5, 9] + run + [400, 410]
    assert (3, 3 + len(run), True) in blocks(pos)
    assert_blocks_partition(pos)


def test_short_runs_far_apart_are_not_grouped_and_still_match_reference() -> None:
    # A system prompt and a question with 6K reused positions between them (a question pass): two
    # blocks, so no query attends over the context through the masked kernel.
    pos = list(range(0, 20)) + list(range(6000, 6018))
    assert blocks(pos) == [(0, 20, False), (20, 38, False)]
    q, k, v = make_qkv(pos[-1] + 1, 3)
    assert_matches_reference(q, k, v, torch.tensor(pos))


def test_a_few_scattered_queries_ride_with_the_next_run_and_match_reference() -> None:
    # One chunk's first tokens, four question picks later in it, the next chunk's first tokens: the
    # picks join the next chunk's run (one pass over the prefix instead of two); the two runs, 500
    # positions apart, stay apart.
    first_run = list(range(0, 90))
    picks = [200, 310, 420, 480]
    next_run = list(range(500, 590))
    pos = first_run + picks + next_run
    assert blocks(pos) == [(0, 90, True), (90, 184, False)]
    q, k, v = make_qkv(pos[-1] + 1, 3)
    assert_matches_reference(q, k, v, torch.tensor(pos))


def test_a_run_too_costly_to_join_opens_its_own_causal_block() -> None:
    # Forty picks 300 positions before a run: joining would add 40 * 300+ masked products.
    picks = list(range(0, 400, 10))
    run = list(range(700, 700 + MIN_RUN))
    assert blocks(picks + run) == [(0, 40, False), (40, 40 + MIN_RUN, True)]
    q, k, v = make_qkv(run[-1] + 1, 2, seed=10)
    assert_matches_reference(q, k, v, torch.tensor(picks + run))
