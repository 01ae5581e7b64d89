"""The C2KV extractor: trained projections that turn a document into one KV row per block of k tokens.

A document of n tokens gets m = ceil(n / k) auxiliary C2Tokens appended after it. They share one
learned embedding, and at every layer they use their own Q/K/V projections (shaped like the base
model's, initialised as copies of them) with the model's frozen norms, output projection and MLP.
C2Token j stands at the position of the last token of block j and sees the sink block (the first k
document tokens), its own block, every earlier C2Token and itself; document tokens never see a
C2Token, so their KV is exactly the frozen model's (the stored chunk KV). Only the C2Tokens' keys
(before RoPE) and values are kept: 4x fewer rows that compose with other documents' at any position.

The document side is therefore the chunk encoding cachetune already stores: extraction reads the
chunk's per-layer pre-RoPE K/V and runs only the m C2Tokens through the layers.

The residual variant (C2KV-Residual) adds, at the first layer, the mean of the block's normed document
hidden states (layer 0's input norm of their embeddings) to the C2Token's normed input of its Q/K/V
projections, as the public reference code does; the residual stream itself is not changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachetune.c2kv.tokens import TokensFileError, TrainedTokens
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.dense import dense_forward

FORMAT = "cachetune-c2kv-extractor/1"
ExtractorError = TokensFileError  # an extractor file that is unreadable, or made for another model or layout


@dataclass(frozen=True)
class ExtractorConfig:
    block: int = 4            # document tokens per C2Token (the compression ratio k)
    residual: bool = False    # C2KV-Residual: add the block's mean normed hidden state at layer 0
    anchor: bool = False      # C2Token j enters as its block's last token's embedding + the learned offset
    lora_rank: int = 0        # 0: train full copies of the projections; r > 0: frozen copies + rank-r LoRA
    lora_alpha: float = 32.0  # LoRA scale numerator (scale = alpha / rank)

    def __post_init__(self) -> None:
        for name in ("block", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "block" else 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'block' else 0}, got {value!r}")


def block_ends(n: int, block: int) -> torch.Tensor:
    """Local position of the last token of each block of a document of n tokens: [ceil(n / block)]."""
    return torch.clamp(torch.arange(1, math.ceil(n / block) + 1) * block, max=n) - 1


def c2_visibility(n: int, block: int) -> torch.Tensor:
    """visible [m, n + m]: what C2Token j attends to over [document tokens, C2Tokens].

    Document token i is visible iff it is in the sink block (i < block) or in j's own block; C2Token
    i is visible iff i <= j (earlier C2Tokens of the same document, and itself)."""
    m = math.ceil(n / block)
    owner = torch.arange(n) // block                                 # block of each document token
    doc = (owner[None, :] == torch.arange(m)[:, None]) | (torch.arange(n) < block)[None, :]
    own = torch.ones(m, m, dtype=torch.bool).tril()
    return torch.cat([doc, own], dim=1)


class C2Extractor(TrainedTokens):
    """The trainable part of C2KV for one base model: one C2Token embedding [hidden] and per-layer Q/K/V.

    A new extractor is the step-0 one: projections that are exact copies of the base ones and the EOS
    token's embedding, so untrained it is already a sensible extractor (its C2Tokens read their block
    like an EOS token would)."""

    FORMAT = FORMAT
    CONFIG = ExtractorConfig
    VARIANT = "c2kv"
    STEP0 = {"step0": ExtractorConfig(), "step0+residual": ExtractorConfig(residual=True),
             "step0+anchor": ExtractorConfig(anchor=True)}

    def __init__(self, adapter: ModelAdapter, config: ExtractorConfig, base_identity: str, eos_id: int):
        if any(info.sliding_window is not None for info in adapter.layer_info):
            raise ValueError("C2KV does not support sliding-window attention (compressed rows break windows)")
        super().__init__(adapter, config, base_identity, eos_id, count=None)
        if config.anchor:  # the shared embedding becomes an offset on each block's own token: 0 at step 0
            with torch.no_grad():
                self.embedding.zero_()


def extract_c2kv(
    adapter: ModelAdapter,
    extractor: C2Extractor,
    token_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    backend: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C2KV of one document from its stored chunk KV.

    token_ids: [n]; keys/values: [L, n, Hkv, D] the document's own pre-RoPE K and V (encoded alone at
    positions 0..n-1). Returns C2 keys (pre-RoPE) and values [L, m, Hkv, D] and their local
    positions [m] (block ends). Differentiable in the extractor's parameters; the document side is
    read, never recomputed.
    """
    n = int(token_ids.numel())
    block = extractor.config.block
    device = adapter.device
    positions = block_ends(n, block).to(device)
    m = positions.numel()
    dtype = adapter.dtype
    hidden = extractor.embedding.to(dtype).expand(m, -1)
    if extractor.config.anchor:
        with torch.no_grad():
            anchors = adapter.embed(token_ids.to(device)[positions])  # [m, hidden] each block's last token
        hidden = hidden + anchors
    shift = None
    if extractor.config.residual:
        with torch.no_grad():  # the document side is frozen
            normed = adapter.layers[0].input_layernorm(adapter.embed(token_ids.to(device)))  # [n, hidden]
        owner = torch.arange(n, device=device) // block
        sums = torch.zeros(m, normed.shape[1], dtype=normed.dtype, device=device).index_add_(0, owner, normed)
        shift = sums / torch.bincount(owner, minlength=m).to(normed.dtype)[:, None]  # [m, hidden]
    doc_rope = adapter.rope_tables(torch.arange(n, device=device))
    out_k = [None] * adapter.num_layers
    out_v = [None] * adapter.num_layers

    def context(layer: int):
        cos, sin = doc_rope[adapter.layer_info[layer].rope_kind]
        return adapter.rotate(keys[layer].to(device, dtype), cos, sin), values[layer].to(device, dtype)

    def capture(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        out_k[layer], out_v[layer] = k, v

    def projections(layer: int):
        return [_Projection(p, dtype, shift if layer == 0 else None) for p in extractor.projections(layer)]

    dense_forward(adapter, hidden, positions, c2_visibility(n, block).to(device), context, projections, capture,
                  backend)
    return torch.stack(out_k), torch.stack(out_v), positions.cpu()


class _Projection(torch.nn.Module):
    """A trainable (fp32) projection applied to normed activations of the model's dtype, with the
    residual variant's block mean added to its input at layer 0."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype, shift: torch.Tensor | None):
        super().__init__()
        self.inner, self.dtype, self.shift = inner, dtype, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift is not None:
            x = x + self.shift
        return self.inner(x.float()).to(self.dtype) if self.dtype != torch.float32 else self.inner(x)
