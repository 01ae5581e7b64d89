"""Evaluation metrics as pure functions: answer F1 / EM, ROUGE-L, fidelity to a reference prefill, latency summaries.

Answer scoring follows SQuAD / LongBench `qa_f1`: normalize, split on whitespace, bag-of-words F1, max
over the gold answers. Like CacheBlend, only the first non-empty line of a generation is scored, since
small models keep talking after the answer. Summaries are scored whole with ROUGE-L F (`rouge-score`).
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, drop ASCII punctuation and a/an/the, squash whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def first_line(prediction: str) -> str:
    """The first line of `prediction` with any non-whitespace in it ("" when there is none)."""
    return next((line for line in prediction.splitlines() if line.strip()), "")


def _prediction_tokens(prediction: str, collapse_yes_no: bool) -> list[str]:
    tokens = normalize_answer(first_line(prediction)).split()
    # CacheBlend scores "Yes, he did." as "Yes"; matched on the whole first word here, so "Norway" stays.
    if collapse_yes_no and tokens and tokens[0] in ("yes", "no"):
        return tokens[:1]
    return tokens


def _token_f1(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:
        return float(pred == gold)  # SQuAD: an empty side scores 1 only when both are empty
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: Sequence[str], *, collapse_yes_no: bool = False) -> float:
    """Max token F1 of the first non-empty line of `prediction` over the gold `answers`.

    `collapse_yes_no` applies CacheBlend's rule (a first word of yes/no is the whole answer); it matters
    for 2WikiMQA, where some gold answers are "yes"/"no".
    """
    if not answers:
        raise ValueError("f1_score needs at least one gold answer")
    pred = _prediction_tokens(prediction, collapse_yes_no)
    return max(_token_f1(pred, normalize_answer(a).split()) for a in answers)


def exact_match(prediction: str, answers: Sequence[str], *, collapse_yes_no: bool = False) -> float:
    """1.0 when the normalized first non-empty line of `prediction` equals a normalized gold answer."""
    if not answers:
        raise ValueError("exact_match needs at least one gold answer")
    pred = " ".join(_prediction_tokens(prediction, collapse_yes_no))
    return float(any(pred == normalize_answer(a) for a in answers))


def rouge_l(prediction: str, references: str | Sequence[str]) -> float:
    """Max ROUGE-L F-measure of `prediction` over `references` (Porter-stemmed, case and punctuation ignored).

    ROUGE-L compares the longest common subsequence of tokens: P = LCS / len(pred), R = LCS / len(ref).
    """
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("rouge_l needs at least one reference")
    scorer = _rouge_scorer()
    return float(max(scorer.score(ref, prediction)["rougeL"].fmeasure for ref in refs))


@functools.cache
def _rouge_scorer() -> Any:
    # Imported on first use: rouge_score pulls in nltk, which callers scoring only QA never need.
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def score_answer(task: str, prediction: str, answers: Sequence[str]) -> float:
    """The task's answer metric: "qa" -> `f1_score` (first line), "summarization" -> `rouge_l` (whole text)."""
    if task == "qa":
        return f1_score(prediction, answers)
    if task == "summarization":
        return rouge_l(prediction, answers)
    raise ValueError(f"unknown task {task!r} (expected 'qa' or 'summarization')")


def kl_to_reference(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """Per-position KL(softmax(ref_logits) || softmax(logits)) in nats.

    ref_logits, logits: [T, V] (any [..., V] works) -> [...], float32.
    Computed from log_softmax in float32 so bf16 logits and huge vocabularies do not under/overflow.
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_p = ref_logp.exp()
    # NOTE: tokens the reference gives probability 0 (masked to -inf) contribute 0, not 0 * inf = nan.
    terms = torch.where(ref_p > 0, ref_p * (ref_logp - logp), torch.zeros_like(ref_p))
    return terms.sum(dim=-1).clamp_min(0.0)  # KL >= 0; clamp float rounding noise like -1e-8


def top1_agreement(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """Per-position bool: does the argmax token match the reference's? [T, V] -> [T]."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    return ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """n, mean, median, p95 (linear interpolation, as numpy.percentile), min and max, e.g. of TTFTs."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("summarize needs at least one value")
    return {
        "n": float(arr.size),
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p95": float(np.percentile(arr, 95)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


def bootstrap_mean(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-example values (examples resampled)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"need a non-empty list of values, got shape {x.shape}")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    lo, hi = np.percentile(x[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def paired_ratio(scores: Sequence[float], reference: Sequence[float], *, resamples: int = 2000,
                 seed: int = 0) -> dict[str, float]:
    """Mean score over mean reference score on the same examples, with a 95% percentile-bootstrap interval
    (examples resampled with replacement, both methods together, so the pairing is kept), and how many
    examples score above / below the reference. Small QA samples have many zeros; the interval says how
    much the ratio means."""
    s = np.asarray(scores, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    if s.shape != ref.shape or s.ndim != 1 or s.size == 0:
        raise ValueError(f"need two equal-length, non-empty score lists, got {s.shape} and {ref.shape}")
    idx = np.random.default_rng(seed).integers(0, s.size, size=(resamples, s.size))
    num, den = s[idx].mean(axis=1), ref[idx].mean(axis=1)
    ratios = np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)
    ratios = ratios[~np.isnan(ratios)]  # resamples where the reference scores 0 everywhere have no ratio
    nan = float("nan")
    lo, hi = (float(x) for x in np.percentile(ratios, [2.5, 97.5])) if ratios.size else (nan, nan)
    return {
        "ratio": float(s.mean() / ref.mean()) if ref.mean() > 0 else nan,
        "ci_low": lo,
        "ci_high": hi,
        "better": float((s > ref).sum()),
        "worse": float((s < ref).sum()),
    }
