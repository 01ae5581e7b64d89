"""Independent chunk encoding: the KV that a chunk produces on its own, stored for reuse.

A chunk is encoded with nothing before it: its tokens sit at positions 0..N-1, exactly as if the chunk
were the whole prompt. So a chunk placed at position 0 of a request reuses precisely what a full
prefill of that text would compute, and elsewhere it differs only by the missing cross-chunk
attention, which selective recompute restores. Keys are kept before RoPE (deferred RoPE): the engine
rotates them at whatever global positions the chunk lands on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from cachetune.chunks.kv import encode_kv
from cachetune.chunks.rankers import ChunkView, Ranker, RankingContext, get_ranker
from cachetune.chunks.ranking import ranking_from_scores, scores_from_ranking
from cachetune.model.adapter import ModelAdapter

# Bump when what a chunk id stands for changes (prefix policy, key layout), so old caches never match.
ENCODING_VERSION = "ct-chunk-v1:no-prefix:pre-rope-k"


def chunk_id(model_fingerprint: str, token_ids: torch.Tensor, variant: str = "") -> str:
    """Content address of (model, encoding policy, token ids, variant): the same text under another
    model differs, and so do rows derived from it by another encoder (`variant`, e.g. a C2KV
    extractor's fingerprint; "" for the plain chunk encoding)."""
    h = hashlib.sha256()
    h.update(ENCODING_VERSION.encode())
    h.update(model_fingerprint.encode())
    h.update(token_ids.to(torch.int64).cpu().numpy().tobytes())
    if variant:
        h.update(b"\0variant:" + variant.encode())
    return h.hexdigest()[:32]


@dataclass
class EncodedChunk:
    """One chunk's reusable state. keys/values: [L, R, Hkv, D], keys before RoPE, one row per token
    in token order (R = N), or, for compressed encodings (C2KV), R rows standing at the local
    `positions` [R] of the chunk's N tokens."""

    chunk_id: str
    token_ids: torch.Tensor   # [N] int64
    keys: torch.Tensor
    values: torch.Tensor
    ranking: torch.Tensor     # [R] local row indices, most worth recomputing first
    scores: torch.Tensor | None = None  # [R] float32 behind `ranking` (None: derived from it)
    ranker: str = "lf"        # the offline ranker that produced them
    positions: torch.Tensor | None = None  # [R] int64 strictly increasing in [0, N); None: row i at i
    variant: str = ""         # what made the rows ("" plain encoding; chunk_id's variant)

    def __post_init__(self) -> None:
        if self.scores is None:
            self.scores = scores_from_ranking(self.ranking)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


@torch.no_grad()
def encode_chunk(
    adapter: ModelAdapter, token_ids: torch.Tensor, model_fingerprint: str, ranker: Ranker | None = None,
    context: RankingContext | None = None,
) -> EncodedChunk:
    """Run the chunk alone through the model, keep per-layer pre-RoPE K and V and rank its tokens
    (by `ranker`, default the paper's `lf`; model-running rankers need `context`)."""
    if token_ids.numel() == 0:
        raise ValueError("cannot cache an empty chunk")
    ids = token_ids.to(adapter.device, torch.int64)
    keys, values = (x.cpu() for x in encode_kv(adapter, ids))
    ranker = ranker or get_ranker("lf")
    scores = ranker.scores(ChunkView(ids.cpu(), keys, values, context))
    return EncodedChunk(chunk_id(model_fingerprint, ids), ids.cpu(), keys, values, ranking_from_scores(scores),
                        scores, ranker.name)
