"""Block-Attention: full reuse of chunks encoded alone by a model fine-tuned for it (blockattn.model).

`prepare` encodes each chunk once with the fine-tuned model and stores that KV beside the chunk's
own, under an id of the fine-tune's fingerprint; `prefill` reuses it (keys re-rotated where the chunk
lands) and computes the uncached text with the fine-tuned model, which also decodes the request.

    block_attention           the bundled fine-tune (EngineConfig.block_attention_weights)
    block_attention:step0     zero adapters: exactly full reuse with the base model
    block_attention:path/to/weights.safetensors
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.blockattn.model import BlockAttentionModel
from cachetune.chunks.encode import EncodedChunk
from cachetune.chunks.kv import encode_kv
from cachetune.config import EngineConfig
from cachetune.methods.base import Method, MethodContext, TrainedMethod, check_name, register
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import Prefill, selective_prefill
from cachetune.store.base import StoredChunk

ORDER = 130


@dataclass(frozen=True)
class BlockAttentionSettings:
    weights: str = EngineConfig.block_attention_weights  # "bundled", "step0" or a file

    def __post_init__(self) -> None:
        check_name("weights", self.weights)


class BlockAttentionMethod(TrainedMethod):
    kind, weights_setting = BlockAttentionModel, "weights"

    def __init__(self, settings: BlockAttentionSettings):
        self.settings = settings

    @torch.no_grad()
    def encode(self, ctx: MethodContext, loaded, chunk: StoredChunk, cid: str) -> EncodedChunk:
        """The chunk as the fine-tuned model encodes it alone."""
        keys, values = encode_kv(loaded.tokens.adapter, chunk.token_ids)
        return EncodedChunk(cid, chunk.token_ids, keys.cpu(), values.cpu(), torch.arange(chunk.num_tokens),
                            ranker="none", variant=loaded.variant)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        adapter = self.loaded(ctx).tokens.adapter
        own = PromptLayout([Segment(s.token_ids, self.rows(ctx, s.chunk)) if s.cached else s for s in layout.segments])
        none = [torch.empty(0, dtype=torch.int64) for _ in own.chunk_segments]
        result = selective_prefill(adapter, own, none, capacity, ctx.pipeline)
        result.adapter = adapter  # its decoding runs on the fine-tuned model too
        return result


@register("block_attention", BlockAttentionSettings, suffix="weights",
          summary="full reuse with a model fine-tuned (LoRA) so documents attend only within themselves")
def _block_attention(settings: BlockAttentionSettings) -> Method:
    return BlockAttentionMethod(settings)
