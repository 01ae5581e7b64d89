"""Drive a Hugging Face causal LM's own modules one layer at a time, on any subset of tokens.

Selective recompute needs what a plain forward hides: the keys before RoPE, a forward over a sparse set
of positions, and attention over a key buffer assembled from two sources. The adapter exposes exactly
those steps and nothing else; it calls the model's embedding, norms, projections, rotary embedding, MLP
and head, so no weight is ever copied into a home-made transformer. Families differ only in a few
switches (q/k norm, sandwich norms, per-layer RoPE tables and sliding windows), read from the modules.

Tensors here have no batch dimension: hidden [T, hidden], q [T, Hq, D], k/v [T, Hkv, D].
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from cachetune.model.int8 import quantize_linears

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run faster than float32 here: a GPU that supports it, or a CPU
    with AMX or AVX512-BF16 (several times faster there; on an AVX2-only CPU, slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_amx_tile_supported", None), getattr(cpu, "_is_avx512_bf16_supported", None))
    return any(check() for check in checks if check is not None)


class UnsupportedModelError(ValueError):
    """The architecture is not one the adapter knows how to drive layer by layer."""


@dataclass(frozen=True)
class LayerInfo:
    scale: float                 # softmax scale the model's attention uses
    sliding_window: int | None   # keys j visible to query p only if j > p - window
    rope_kind: str | None        # key into the rotary module (Gemma 3 has one table per layer type)


class ModelAdapter:
    """Layer-by-layer access to a supported `transformers` causal LM (batch size 1)."""

    # A serving engine's own kernel for the runtime's causal attention of scattered queries, called as
    # kernel(layer, q, keys, values, q_pos, scale, sliding_window, plan) with the contract of
    # runtime.attention.sparse_causal_attention (plan: its blocks for q_pos); None: the runtime's.
    attention_kernel = None

    def __init__(self, model: PreTrainedModel):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported for KV reuse; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        kinds = {rope.get("rope_type")} if "rope_type" in rope else {p.get("rope_type") for p in rope.values()}
        if kinds & LENGTH_DEPENDENT_ROPE:
            # Their tables change with sequence length, so keys rotated for one layout are wrong in another.
            raise UnsupportedModelError(f"RoPE type(s) {sorted(kinds & LENGTH_DEPENDENT_ROPE)} are not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention cannot reuse causal chunk caches")
        self.model = model
        self.config = config
        self.backbone = model.model
        self.layers = list(self.backbone.layers[: config.num_hidden_layers])
        self.cast_dtype: torch.dtype | None = None  # set on a cast copy (see cast); None: the weights'
        self._casts: dict[torch.dtype, list] = {}   # layers cast to a dtype, first ones first
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.sandwich_norms = hasattr(self.layers[0], "pre_feedforward_layernorm")
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self._rotate_half = importlib.import_module(type(model).__module__).rotate_half
        layer_types = getattr(config, "layer_types", None)
        self.layer_info = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            if getattr(a, "attn_logit_softcapping", None) is not None:
                raise UnsupportedModelError("attention logit soft-capping is not supported")
            window = a.sliding_window if hasattr(a, "sliding_window") else getattr(config, "sliding_window", None)
            rope_kind = layer_types[i] if model_type == "gemma3_text" else None
            self.layer_info.append(LayerInfo(float(a.scaling), window, rope_kind))

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head size): the shape of one KV row per layer."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    def across_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [...] reduced (a mean or a sum) over the heads this process holds -> the same over
        every head of the model, up to a constant factor. One process holds every head here; a
        tensor-parallel rank holds some (cachetune.vllm.parallel), and selections call this so that
        every rank picks what one process holding every head would."""
        return scores

    @property
    def dtype(self) -> torch.dtype:
        return self.cast_dtype or self.backbone.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, hidden] (Gemma's scaled embedding is part of its module)."""
        return self.backbone.embed_tokens(ids.to(self.device)).to(self.dtype)

    def cast(self, layers: int, dtype: torch.dtype) -> ModelAdapter:
        """An adapter over this model's first `layers` layers with their weights cast to `dtype`, for
        passes that need only an approximate answer (a selection signal): bfloat16 runs several times
        faster than float32 on GPUs and AMX CPUs. The cast layers are made once and kept (memory:
        `layers` layers at dtype's size); embedding and rotary tables are shared, their outputs cast.
        `layers` at most num_layers; this adapter itself when nothing would change.

        dtype torch.int8 (CPU only, model.int8): the layers' linear weights in int8, their inputs
        quantized per call, everything else (the view's dtype) in bfloat16 where it is fast, else
        float32."""
        layers = max(1, min(layers, self.num_layers))
        if dtype == self.dtype:
            return self
        compute = dtype
        if dtype == torch.int8:
            compute = torch.bfloat16 if fast_bfloat16(self.device) else torch.float32
        cast = self._casts.setdefault(dtype, [])
        for layer in self.layers[len(cast):layers]:  # copy one layer at a time: no full-size transient
            copied = copy.deepcopy(layer).to(compute)
            cast.append(quantize_linears(copied) if dtype == torch.int8 else copied)
        view = copy.copy(self)
        view.layers, view.num_layers, view.layer_info = cast[:layers], layers, self.layer_info[:layers]
        view.cast_dtype, view._casts = compute, {}
        return view

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype | None = None
                    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [T, D] at `positions` for every RoPE kind the layers use, in `dtype` (None: the model's)."""
        probe = torch.empty(0, dtype=dtype or self.dtype, device=self.device)
        pos = positions.view(1, -1)
        tables = {}
        for kind in {info.rope_kind for info in self.layer_info}:
            if kind is None:
                cos, sin = self.backbone.rotary_emb(probe, pos)
            else:
                cos, sin = self.backbone.rotary_emb(probe, pos, kind)
            tables[kind] = (cos[0], sin[0])
        return tables

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE: x [T, H, D], cos/sin [T, D] (the models' own rotate_half convention)."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + self._rotate_half(x) * sin

    def project_qkv(self, layer: int, hidden: torch.Tensor, projections=None):
        """Pre-RoPE q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of `hidden` [T, hidden] at `layer`.

        `projections` (q, k, v modules shaped like the layer's own) replace its Q/K/V projections;
        the norms stay the model's (C2KV's extractor brings its own projections for its tokens)."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        t = x.shape[0]
        q_proj, k_proj, v_proj = projections or (attn.q_proj, attn.k_proj, attn.v_proj)
        q = q_proj(x).view(t, -1, self.head_dim)
        k = k_proj(x).view(t, -1, self.head_dim)
        v = v_proj(x).view(t, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP: hidden [T, hidden], attn_out [T, Hq, D] -> [T, hidden]."""
        block = self.layers[layer]
        o = block.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        if self.sandwich_norms:
            hidden = hidden + block.post_attention_layernorm(o)
            return hidden + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(hidden)))
        hidden = hidden + o
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab] in float32."""
        logits = self.model.lm_head(self.backbone.norm(hidden)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
