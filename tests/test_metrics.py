import math

import pytest
import torch

from cachetune.eval.metrics import (
    bootstrap_mean,
    exact_match,
    f1_score,
    first_line,
    kl_to_reference,
    normalize_answer,
    paired_ratio,
    rouge_l,
    score_answer,
    summarize,
    top1_agreement,
)


# --- answer normalization and F1 -------------------------------------------------------------


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces() -> None:
    assert normalize_answer("  The Exeter  College, Oxford. ") == "exeter college oxford"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words


def test_f1_exact_answer_is_one() -> None:
    assert f1_score("Exeter College", ["Exeter College"]) == 1.0
    assert f1_score("the exeter college.", ["Exeter College"]) == 1.0


def test_f1_partial_overlap_matches_hand_computation() -> None:
    # 2 common tokens; precision 2/3, recall 2/2 -> F1 = 2 * (2/3) * 1 / (2/3 + 1) = 0.8
    assert f1_score("Exeter College Oxford", ["Exeter College"]) == pytest.approx(0.8)
    # {university, oxford} common; precision 2/3, recall 2/3 -> F1 = 2/3
    assert f1_score("University of Oxford", ["Oxford University Press"]) == pytest.approx(2 / 3)


def test_f1_counts_repeated_tokens_as_a_multiset() -> None:
    # "new york new york" vs "new york": 2 common, precision 2/4, recall 1 -> 2/3
    assert f1_score("New York, New York", ["New York"]) == pytest.approx(2 / 3)
    # "bora bora" vs "bora bora island": both "bora"s count, precision 1, recall 2/3 -> 0.8 (a set gives 0.4)
    assert f1_score("Bora Bora", ["Bora Bora Island"]) == pytest.approx(0.8)


def test_f1_no_overlap_is_zero() -> None:
    assert f1_score("Cambridge", ["Exeter College"]) == 0.0
    assert f1_score("", ["Exeter College"]) == 0.0


def test_f1_scores_only_the_first_non_empty_line() -> None:
    assert f1_score("Exeter College\nHe studied in Oxford.", ["Exeter College"]) == 1.0
    assert f1_score("\n \n  Exeter College\nmore text", ["Exeter College"]) == 1.0
    assert f1_score("Cambridge\nExeter College", ["Exeter College"]) == 0.0
    assert first_line("\r\n\t\nanswer\r\nrest") == "answer"
    assert first_line("\n  \n") == ""


def test_f1_takes_the_max_over_gold_answers() -> None:
    assert f1_score("Paris", ["London", "Paris"]) == 1.0
    # vs "Oxford": precision 1/3, recall 1 -> 0.5; vs "Exeter College": 0.8
    assert f1_score("Exeter College Oxford", ["Oxford", "Exeter College"]) == pytest.approx(0.8)


def test_f1_needs_a_gold_answer() -> None:
    with pytest.raises(ValueError):
        f1_score("x", [])


def test_collapse_yes_no_keeps_only_a_leading_yes_or_no_word() -> None:
    # "yes he did" vs "yes": precision 1/3, recall 1 -> 0.5 without the CacheBlend rule
    assert f1_score("Yes, he did.", ["yes"]) == pytest.approx(0.5)
    assert f1_score("Yes, he did.", ["yes"], collapse_yes_no=True) == 1.0
    assert f1_score("Norway", ["no"], collapse_yes_no=True) == 0.0


def test_exact_match_uses_normalization_and_the_first_line() -> None:
    assert exact_match("Exeter College.\nbecause ...", ["exeter college"]) == 1.0
    assert exact_match("Exeter College Oxford", ["Exeter College"]) == 0.0
    assert exact_match("Croatia", ["Kingdom of Croatia", "croatia"]) == 1.0


# --- ROUGE-L and per-task dispatch --------------------------------------------------------------


def test_rouge_l_identical_is_one_and_disjoint_is_zero() -> None:
    assert rouge_l("Amanda will text Larry.", ["Amanda will text Larry."]) == 1.0
    assert rouge_l("Amanda will text Larry.", ["Hannah bought coffee beans"]) == 0.0
    assert rouge_l("", ["Hannah bought coffee beans"]) == 0.0


def test_rouge_l_partial_overlap_matches_hand_computed_lcs() -> None:
    # pred "police arrested two men" (4), ref "two men were arrested by police" (6): the LCS is
    # "two men" (2), not the 3 shared words, since order matters. P = 2/4, R = 2/6 -> F = 0.4
    assert rouge_l("police arrested two men", ["two men were arrested by police"]) == pytest.approx(0.4)
    # "a b c d" vs "a c e": LCS "a c" = 2, P = 1/2, R = 2/3 -> F = 4/7
    assert rouge_l("a b c d", ["a c e"]) == pytest.approx(4 / 7)


def test_rouge_l_stems_ignores_case_and_punctuation() -> None:
    assert rouge_l("The CATS sat!", ["the cat sat"]) == 1.0  # "cats" -> "cat"


def test_rouge_l_takes_the_max_over_references_and_accepts_one_string() -> None:
    refs = ["two men were arrested by police", "police arrested two men"]
    assert rouge_l("police arrested two men", refs) == 1.0
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)  # not scored character by character
    with pytest.raises(ValueError):
        rouge_l("x", [])


def test_score_answer_dispatches_on_task() -> None:
    prediction = "Exeter College\nHe studied in Oxford."
    # qa: token F1 on the first line only
    assert score_answer("qa", prediction, ["Exeter College"]) == 1.0
    # summarization: ROUGE-L on the whole text, LCS 2 of 6 predicted / 2 reference tokens -> F = 0.5
    assert score_answer("summarization", prediction, ["Exeter College"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="translation"):
        score_answer("translation", prediction, ["x"])


# --- fidelity to a reference prefill ----------------------------------------------------------


def test_kl_is_zero_for_identical_logits() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_to_reference(logits, logits.clone()), torch.zeros(5))


def test_kl_is_invariant_to_a_per_position_logit_shift() -> None:
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    shifted = logits + torch.arange(4.0).unsqueeze(-1) * 100
    assert torch.allclose(kl_to_reference(logits, shifted), torch.zeros(4), atol=1e-5)


def test_kl_is_positive_for_different_logits() -> None:
    g = torch.Generator().manual_seed(2)
    ref, other = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    kl = kl_to_reference(ref, other)
    assert kl.shape == (6,)
    assert bool((kl > 0).all())


def test_kl_matches_hand_computation_on_two_classes() -> None:
    # p = softmax([0, 0]) = [1/2, 1/2]; q = softmax([0, ln 3]) = [1/4, 3/4]
    # KL(p || q) = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3); the reverse direction would be ~0.1308
    ref = torch.tensor([[0.0, 0.0]])
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert kl_to_reference(ref, logits).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)


def test_kl_is_float32_and_finite_for_bf16_large_and_masked_logits() -> None:
    g = torch.Generator().manual_seed(3)
    ref = (torch.randn(3, 50_000, generator=g) * 30).bfloat16()
    logits = (torch.randn(3, 50_000, generator=g) * 30).bfloat16()
    kl = kl_to_reference(ref, logits)
    assert kl.dtype == torch.float32 and bool(torch.isfinite(kl).all())

    masked = torch.tensor([[0.0, float("-inf"), 1.0]])  # a token the reference can never emit
    kl = kl_to_reference(masked, torch.tensor([[0.0, 5.0, 1.0]]))
    assert bool(torch.isfinite(kl).all()) and kl.item() > 0


def test_kl_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 4))


def test_top1_agreement_per_position() -> None:
    ref = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    logits = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    agree = top1_agreement(ref, logits)
    assert agree.dtype == torch.bool
    assert agree.tolist() == [True, False, True]


# --- latency summaries ------------------------------------------------------------------------


def test_summarize_median_and_p95() -> None:
    s = summarize(float(v) for v in range(1, 101))
    assert s["n"] == 100
    assert s["median"] == pytest.approx(50.5)
    assert s["p95"] == pytest.approx(95.05)  # linear interpolation at rank 0.95 * 99
    assert (s["min"], s["max"], s["mean"]) == (1.0, 100.0, pytest.approx(50.5))


def test_summarize_single_value_and_empty() -> None:
    assert summarize([0.25])["p95"] == 0.25
    with pytest.raises(ValueError):
        summarize([])


# --- paired comparison with the reference method -----------------------------------------------

def test_paired_ratio_counts_examples_and_brackets_the_ratio() -> None:
    p = paired_ratio([1.0, 0.0, 1.0, 0.5, 0.0, 1.0], [1.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    assert p["ratio"] == pytest.approx(3.5 / 4.0)
    assert (p["better"], p["worse"]) == (1.0, 1.0)
    assert p["ci_low"] < p["ratio"] < p["ci_high"]


def test_paired_ratio_of_identical_scores_has_no_spread_and_is_seeded() -> None:
    scores = [0.2, 0.0, 0.7, 1.0]
    p = paired_ratio(scores, scores)
    assert (p["ratio"], p["ci_low"], p["ci_high"], p["better"], p["worse"]) == (1.0, 1.0, 1.0, 0.0, 0.0)
    a, b = [0.0, 1.0, 0.3, 0.9], [0.5, 0.5, 0.5, 0.1]
    assert paired_ratio(a, b) == paired_ratio(a, b)


def test_paired_ratio_without_a_reference_score_is_nan_and_bad_input_raises() -> None:
    p = paired_ratio([0.5, 0.0], [0.0, 0.0])
    assert math.isnan(p["ratio"]) and math.isnan(p["ci_low"]) and p["better"] == 1.0
    with pytest.raises(ValueError, match="equal-length"):
        paired_ratio([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="equal-length"):
        paired_ratio([], [])


def test_bootstrap_mean_brackets_the_mean_and_is_seeded() -> None:
    values = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5]
    lo, hi = bootstrap_mean(values)
    assert lo < sum(values) / len(values) < hi
    assert (lo, hi) == bootstrap_mean(values)
    assert bootstrap_mean([0.25, 0.25]) == (0.25, 0.25)
    with pytest.raises(ValueError):
        bootstrap_mean([])
