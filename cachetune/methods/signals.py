"""The question signal: per-token scores a request computes from its own layout, at a small share of a
prefill, so cachetune's selection can pick what this request's question needs.

`question_attention` reads the question's attention over the context while the uncached text runs
over the fully reused chunks through the first `layers` layers (ProphetKV's score at a fraction of
its cost: ProphetKV reads every layer, and uses this function with all of them). It counts toward
the request's time to first token; its scores compare across chunks. The pass may run in a cheaper
dtype (SIGNAL_DTYPES) on a cast copy of the layers it reads.

`deep_focus_price` predicts what the question's pass over every layer costs a request (the
`deep_within` setting of methods.cachetune decides by it, times the machine's measured price scale,
or PRICE_SCALE where it has none).
"""

from __future__ import annotations

import torch

from cachetune.config import DTYPES
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefilled, reuse_plan
from cachetune.model.adapter import ModelAdapter, fast_bfloat16
from cachetune.model.int8 import int8_supported
from cachetune.runtime.attention import plan_blocks, sparse_causal_attention
from cachetune.runtime.forward import AttentionFn, ObserveFn, forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader, Pipeline

# Layers the question signal reads: the first two carry little (positional heads); from the fourth
# on, the gain per layer is small on SmolLM2 while the pass costs more (docs/results.md, selection).
SIGNAL_LAYERS = 4
# The dtype a signal's pass runs in: "model" (the model's own), a DTYPES name, "auto" (bfloat16
# where it is fast, else the model's), or "int8" (int8 weights, inputs quantized per call, the rest
# as "auto" would run it: model.int8; on a CPU only, elsewhere as "auto"). A signal only ranks
# tokens, so it needs no float32 precision.
SIGNAL_DTYPES = ("model", "auto", *DTYPES, "int8")
SIGNAL_DTYPE = "model"
# Deep focus's picks (the question over every layer, half the budget past the chunk starts) add this
# share to `first`'s attention products: they see more rows and ride in wider attention blocks
# (+23% on Qwen MuSiQue rows 56, 76, 16 and 36: results/qwen/selection/ttft_breakdown_deep_focus_amd_musique.md).
EXTRA_ATTENTION = 0.25
# Measured price over predicted where the machine has no calibration of its own (`cachetune
# calibrate-price` measures it): the prediction as counted. On the 2-core AMD EPYC with AVX512-BF16
# the measured scale is 1.05 (95% CI 0.85-1.25; Qwen2.5-1.5B, 85 rows of MuSiQue, 2WikiMQA and
# held-out HotpotQA, experiments/selection/price_fit.py; 0.90 by calibrate-price; docs/results.md, selection).
PRICE_SCALE = 1.0


def linear_macs(adapter: ModelAdapter) -> int:
    """Multiply-adds of one layer's linear maps for one token on this rank: the attention projections
    and a gated MLP, counted from the model's config (vLLM's CPU build repacks weights, leaving the
    parameters' shapes empty), or from the layer's 2-D weights where the config does not give them."""
    config = getattr(adapter, "config", None)
    hidden, inner = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
    if not isinstance(hidden, int) or not isinstance(inner, int):
        return sum(w.numel() for w in adapter.layers[0].parameters() if w.dim() == 2)
    q, kv = adapter.num_heads * adapter.head_dim, adapter.num_kv_heads * adapter.head_dim  # this rank's
    share = adapter.num_heads / config.num_attention_heads  # this rank's share of the MLP
    return int(hidden * (2 * q + 2 * kv) + 3 * hidden * inner * share)


def deep_focus_price(adapter: ModelAdapter, layout: PromptLayout, ratio: float, dtype: str,
                     extra_attention: float = EXTRA_ATTENTION) -> float:
    """Deep focus's predicted price over `first` at `ratio`: (its question pass over every layer + its
    picks' extra attention) / first's prefill, counted in multiply-adds.

    A token's linear maps cost linear_macs (halved in a pass that runs in bfloat16 or int8 where those
    are fast: pass_dtype), its attention a query-key and a value product per row up to it. `first`
    runs the uncached text and each chunk's first round(ratio x n) tokens; the pass runs the uncached
    text over every layer; deep focus's picks lie deeper in their chunks and ride in wider attention
    blocks, which adds `extra_attention` of first's attention products. The price falls with the
    prompt's length where the linear maps dominate (Qwen2.5-1.5B on MuSiQue) and stays high on short
    prompts and where attention dominates (SmolLM2-135M)."""
    width = 2 * adapter.num_heads * adapter.head_dim           # multiply-adds per (query, visible row)
    linear = linear_macs(adapter)
    runs = pass_dtype(adapter, dtype)
    cheap = runs == torch.int8 or (runs in (torch.bfloat16, torch.float16) and adapter.dtype == torch.float32
                                   and fast_bfloat16(adapter.device))
    uncached = torch.ones(layout.total, dtype=torch.bool)
    picks, pick_rows = 0, 0.0
    for start, seg in layout.chunk_segments:
        n = seg.chunk.num_tokens
        uncached[start:start + n] = False
        k = round(ratio * n)                                    # first's picks: rows start .. start + k - 1
        picks, pick_rows = picks + k, pick_rows + k * (start + (k + 1) / 2)
    asked = int(uncached.sum())
    asked_rows = float((uncached.nonzero().flatten() + 1).sum())  # rows the uncached queries see
    first_attention = width * (asked_rows + pick_rows)
    first = (asked + picks) * linear + first_attention
    reading = asked * linear * (0.5 if cheap else 1.0) + width * asked_rows
    return (reading + extra_attention * first_attention) / first


def pass_dtype(adapter: ModelAdapter, dtype: str) -> torch.dtype:
    """What a signal pass asked to run in `dtype` (SIGNAL_DTYPES) runs in here: torch.int8 for int8
    weights (model.int8), else the floating dtype of its layers."""
    if dtype not in SIGNAL_DTYPES:
        raise ValueError(f"unknown signal dtype {dtype!r}; known: {', '.join(SIGNAL_DTYPES)}")
    if dtype == "int8" and int8_supported(adapter.device):
        return torch.int8
    if dtype == "model" or (dtype in ("auto", "int8") and not fast_bfloat16(adapter.device)):
        return adapter.dtype
    return DTYPES.get(dtype, torch.bfloat16)


def signal_adapter(adapter: ModelAdapter, layers: int, dtype: str) -> ModelAdapter:
    """The adapter a signal pass over layers [0, layers) runs on, in `dtype` (SIGNAL_DTYPES)."""
    return adapter.cast(layers, pass_dtype(adapter, dtype))


class QuestionAttention:
    """A forward observer: per layer, the question's attention over every key position.

    The question is the layout's last segment (it ends the prompt, so its queries are the last
    active rows). per_layer[l] is [total] float32: softmax attention averaged over heads and question
    positions (causal; each row sums to 1, so the vector does too). `attend` is the pass's attention
    that reuses those probabilities for the question's own output.
    """

    def __init__(self, adapter: ModelAdapter, layout: PromptLayout):
        self.adapter = adapter
        self.q_pos = torch.arange(layout.starts[-1], layout.total, device=adapter.device)
        self.total = layout.total
        self.per_layer: list[torch.Tensor] = []
        self.probs: torch.Tensor | None = None  # the last observed layer's [Hkv, G, Tq, S]
        self.rest_plan = None                   # the attention plan of the active rows before the question

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        t, kv_heads, d = self.q_pos.numel(), keys.shape[1], keys.shape[2]
        qq = q[-t:].float().view(t, kv_heads, -1, d)                 # [Tq, Hkv, G, D]: no copy of K per group
        logits = torch.einsum("tkgd,skd->kgts", qq, keys.float()) * self.adapter.layer_info[layer].scale
        first = int(self.q_pos[0])  # keys before the question are visible to all of it: mask its own span only
        own = torch.arange(first, keys.shape[0], device=keys.device)[None, :] > self.q_pos[:, None]
        logits[..., first:].masked_fill_(own, float("-inf"))
        probs = torch.softmax(logits, dim=-1)                        # [Hkv, G, Tq, S]
        row = torch.zeros(self.total, device=keys.device)
        row[: keys.shape[0]] = probs.mean(dim=(0, 1, 2))
        self.per_layer.append(row)
        self.probs = probs

    def attend(self, layer: int, q: torch.Tensor, cache: KVCache, rows: torch.Tensor) -> torch.Tensor:
        """forward's AttentionFn for a pass this observer watches: the question's rows are the
        probabilities just observed times the values (its query-key products are not computed
        twice), the rows before it causal attention as usual. q [T, Hq, D] -> [T, Hq, D]."""
        info = self.adapter.layer_info[layer]
        end = int(rows[-1]) + 1
        keys, values = cache.keys[layer, :end], cache.values[layer, :end]
        if self.probs is None or (info.sliding_window is not None and info.sliding_window < end):
            # Nothing observed, or a windowed layer: the observed probabilities span every key.
            return sparse_causal_attention(q, keys, values, rows, info.scale, info.sliding_window)
        t, d = self.q_pos.numel(), q.shape[-1]
        own = torch.einsum("kgts,skd->tkgd", self.probs, values.float()).reshape(t, -1, d)  # [Tq, Hq, D]
        self.probs = None
        if rows.numel() == t:
            return own.to(q.dtype)
        if self.rest_plan is None:
            self.rest_plan = plan_blocks(rows[:-t], q.shape[1] // keys.shape[1], q.dtype)
        rest = sparse_causal_attention(q[:-t], keys, values, rows[:-t], info.scale, plan=self.rest_plan)
        return torch.cat([rest, own.to(q.dtype)])

    def mean(self) -> torch.Tensor:
        return torch.stack(self.per_layer).mean(dim=0)


def per_chunk(layout: PromptLayout, row: torch.Tensor) -> list[torch.Tensor]:
    """A score per prompt position [total] -> one [N_i] float32 CPU vector per chunk (prompt order)."""
    row = row.float().cpu()
    return [row[start:start + seg.chunk.num_tokens] for start, seg in layout.chunk_segments]


@torch.no_grad()
def observe_reuse(adapter: ModelAdapter, layout: PromptLayout, layers: int, observe: ObserveFn,
                  pipeline: Pipeline = Pipeline(), capacity: int = 0, dtype: str = "model",
                  attention: AttentionFn | None = None) -> Prefilled:
    """Run the uncached text over the fully reused chunks through layers [0, layers) for `observe`,
    computing in `dtype` (SIGNAL_DTYPES; observe sees q and keys in the model's dtype). `attention`:
    the pass's own (None: causal).

    Returns the pass's cache (every layer allocated, `capacity` rows at least, the model's dtype):
    its first `layers` layers hold every chunk row exactly as stored, so a selective prefill can
    continue from it instead of loading them again (runtime.prefill.Prefilled)."""
    layers = max(1, min(layers, adapter.num_layers))
    none = [torch.empty(0, dtype=torch.int64) for _ in layout.chunk_segments]
    active_pos, parts, _ = reuse_plan(layout, none)
    device = adapter.device
    cache = KVCache.empty(adapter.num_layers, max(capacity, layout.total), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    shape = (layers, adapter.num_kv_heads, adapter.head_dim)
    run = signal_adapter(adapter, layers, dtype)
    with LayerLoader(parts, shape, device, adapter.dtype, pipeline) as loader:
        forward_active(run, run.embed(layout.input_ids[active_pos].to(device)), active_pos.to(device),
                       cache, reused=loader, observe=observe, layers=range(layers), last_output=False,
                       attention=attention)
    return Prefilled(cache, layers)


def question_attention(adapter: ModelAdapter, layout: PromptLayout, layers: int, pipeline: Pipeline = Pipeline(),
                       capacity: int = 0, dtype: str = "model",
                       reuse_probs: bool = True) -> tuple[list[torch.Tensor], Prefilled]:
    """Per chunk [N_i]: the question's attention to each token, averaged over heads, question positions
    and layers [0, layers), with every chunk token reused (all layers: ProphetKV's score); and the
    pass's cache (see observe_reuse). `dtype`: the pass's (SIGNAL_DTYPES). `reuse_probs`: the pass's
    attention takes the question's output from the observed probabilities (QuestionAttention.attend;
    the same values to float32 rounding, one query-key product per layer fewer)."""
    observer = QuestionAttention(adapter, layout)
    attention = observer.attend if reuse_probs else None
    prefilled = observe_reuse(adapter, layout, layers, observer, pipeline, capacity, dtype, attention)
    return per_chunk(layout, adapter.across_heads(observer.mean())), prefilled
