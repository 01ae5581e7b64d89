"""vLLM's own model modules, driven one layer at a time by cachetune's runtime.

`VllmAdapter` offers what `cachetune.model.adapter.ModelAdapter` offers the runtime (embed, Q/K/V before
RoPE, rotation, output projection and MLP, logits), over a model vLLM loaded: its norms, fused QKV
projection, rotary cache, output projection and MLP. Attention is never the model's own module, which
reads the current batch's forward context: the runtime attends over its dense staging rows, with vLLM's
own CPU kernel where it applies (vllm.attention). So a blend inside vLLM runs the weights and kernels
vLLM serves with, and no second copy of the model exists.

Tensors here have no batch dimension: hidden [T, hidden], q [T, Hq, D], k/v [T, Hkv, D].
"""

from __future__ import annotations

import copy

import torch

from cachetune.model.adapter import LayerInfo, UnsupportedModelError
from cachetune.vllm.attention import PagedCausalAttention
from cachetune.vllm.parallel import HeadGroup

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VllmAdapter:
    """Layer-by-layer access to a decoder-only model loaded by vLLM (no pipeline stages). Under tensor
    parallelism it is one rank's: its query and KV heads (`heads`), the whole hidden state."""

    def __init__(self, model: torch.nn.Module):
        name = type(model).__name__
        if name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"{name} is not supported inside vLLM; supported: "
                                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        self.model = model
        self.backbone = model.model
        self.config = getattr(model, "config", None)
        layers = list(self.backbone.layers)
        start, end = getattr(self.backbone, "start_layer", 0), getattr(self.backbone, "end_layer", len(layers))
        if (start, end) != (0, len(layers)):
            raise UnsupportedModelError("pipeline parallelism is not supported")
        self.layers = layers
        attn = layers[0].self_attn
        rotary = attn.rotary_emb
        if not getattr(rotary, "is_neox_style", False) or rotary.rotary_dim != rotary.head_size:
            raise UnsupportedModelError("only full-width rotate-half RoPE is supported")
        if type(rotary).__name__ not in ("RotaryEmbedding", "Llama3RotaryEmbedding", "LinearScalingRotaryEmbedding"):
            # Length-dependent tables (dynamic NTK, longrope) rotate a chunk differently in each layout.
            raise UnsupportedModelError(f"RoPE {type(rotary).__name__} is not supported")
        self.num_layers = len(layers)
        self.num_heads = attn.num_heads        # this rank's
        self.num_kv_heads = attn.num_kv_heads  # this rank's
        self.heads = HeadGroup.of(attn.qkv_proj)
        self.head_dim = attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.layer_info = []
        for layer in layers:
            impl = layer.self_attn.attn.impl
            window = getattr(impl, "sliding_window", None)
            window = None if window in (None, -1) else (window[0] + 1 if isinstance(window, tuple) else window)
            self.layer_info.append(LayerInfo(float(impl.scale), window, None))
        self._cos_sin = rotary.cos_sin_cache  # [max positions, D]: cos halves then sin halves
        self.attention_kernel = PagedCausalAttention(layers)

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed_tokens.weight.dtype

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    @property
    def vocab_size(self) -> int:
        return self.backbone.embed_tokens.num_embeddings

    def across_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """model.adapter.ModelAdapter.across_heads: the mean over every rank's heads."""
        return self.heads.mean(scores)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> hidden [T, hidden]."""
        return self.backbone.embed_tokens(ids.to(self.device))

    def cast(self, layers: int, dtype: torch.dtype) -> VllmAdapter:
        """An adapter over the first `layers` layers. vLLM's weights are not copied into another dtype:
        a signal pass runs in the served dtype (the result is the same, only not faster)."""
        view = copy.copy(self)
        layers = max(1, min(layers, self.num_layers))
        view.layers, view.num_layers, view.layer_info = self.layers[:layers], layers, self.layer_info[:layers]
        return view

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype | None = None
                    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [T, D] at `positions` (rotate-half layout), read from vLLM's own rotary cache."""
        table = self._cos_sin.index_select(0, positions.to(self._cos_sin.device).long())
        cos, sin = table.chunk(2, dim=-1)
        dtype = dtype or self.dtype
        return {None: (torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype))}

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE: x [T, H, D], cos/sin [T, D]."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + _rotate_half(x) * sin

    def project_qkv(self, layer: int, hidden: torch.Tensor, projections=None):
        """Pre-RoPE q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of `hidden` [T, hidden] at `layer`."""
        if projections is not None:
            raise ValueError("replacement projections are not supported inside vLLM")
        block = self.layers[layer]
        attn = block.self_attn
        t = hidden.shape[0]
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.reshape(t, -1, self.head_dim), k.reshape(t, -1, self.head_dim), v.reshape(t, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP: hidden [T, hidden], attn_out [T, Hq, D] -> [T, hidden]."""
        block = self.layers[layer]
        o, _ = block.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1).contiguous())
        hidden = hidden + o
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab] in float32 (on every rank:
        vLLM's own gathers them to the rank that samples only)."""
        hidden = self.backbone.norm(hidden)
        if self.heads.size == 1:
            return self.model.compute_logits(hidden).float()
        from vllm.distributed import tensor_model_parallel_all_gather

        processor = self.model.logits_processor
        shard = processor(self.model.lm_head, hidden, skip_gather=True)  # [T, vocab / tp] padded
        return tensor_model_parallel_all_gather(shard, dim=-1)[..., :processor.org_vocab_size].float()
