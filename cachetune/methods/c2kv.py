"""C2KV: every chunk served from its trained, 4x-compressed C2KV rows, with nothing recomputed.

`prepare` (offline, untimed) runs the extractor over the chunk's stored KV once and puts the C2 rows
into the same chunk store as every other chunk KV, under an id derived from the chunk's tokens and
the extractor's fingerprint (another extractor never reuses them). `prefill` loads only those rows,
rotates them at the chunk's start plus their block-end positions and computes the uncached text at
its full-prompt positions (the question starts after the *original* lengths of the documents).

    c2kv                    the bundled trained extractor of the engine's model (EngineConfig.c2kv_extractor)
    c2kv:paper              the extractor built as the paper builds it (EOS-initialised C2Tokens); not
                            shipped: `make c2kv-paper` builds it (c2kv.bank.built_dir())
    c2kv:step0              the untrained extractor (copies of the base projections): what training buys
    c2kv:step0+anchor       untrained, anchored C2Tokens (each starts as its block's last token)
    c2kv:path/to/file.safetensors
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.c2kv.bank import LoadedTokens
from cachetune.c2kv.extractor import C2Extractor, extract_c2kv
from cachetune.chunks.encode import EncodedChunk
from cachetune.config import EngineConfig
from cachetune.methods.base import Method, MethodContext, TrainedMethod, MAX_TOKENS, check_int, check_name, register
from cachetune.methods.compressed import compressed_rows
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import Prefill, compressed_prefill
from cachetune.store.base import StoredChunk

ORDER = 110


@dataclass(frozen=True)
class C2KVSettings:
    extractor: str = EngineConfig.c2kv_extractor  # "bundled", "paper", a step-0 name or a file
    block: int = 4  # document tokens per C2 row; must be the extractor's (the KV budget reserves by it)

    def __post_init__(self) -> None:
        check_name("extractor", self.extractor)
        check_int("block", self.block, maximum=MAX_TOKENS)


@torch.no_grad()
def encode_c2kv(ctx: MethodContext, loaded: LoadedTokens, chunk: StoredChunk, cid: str) -> EncodedChunk:
    """The C2 rows of a stored chunk as an EncodedChunk (rows at their local block-end positions)."""
    adapter = ctx.adapter
    all_rows = torch.arange(chunk.num_tokens)
    kv = [chunk.load_layer(layer, all_rows) for layer in range(adapter.num_layers)]
    keys, values = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
    k, v, positions = extract_c2kv(adapter, loaded.tokens, chunk.token_ids, keys, values)
    return EncodedChunk(cid, chunk.token_ids, k.cpu(), v.cpu(), torch.arange(positions.numel()), ranker="none",
                        positions=positions, variant=loaded.variant)


class C2KVMethod(TrainedMethod):
    kind, weights_setting = C2Extractor, "extractor"

    def __init__(self, settings: C2KVSettings):
        self.settings = settings

    def check(self, loaded: LoadedTokens) -> None:
        if loaded.block != self.settings.block:
            raise ValueError(f"extractor {self.settings.extractor!r} stores one row per {loaded.block} tokens, "
                             f"not {self.settings.block}; pass block={loaded.block}")

    def encode(self, ctx: MethodContext, loaded: LoadedTokens, chunk: StoredChunk, cid: str) -> EncodedChunk:
        return encode_c2kv(ctx, loaded, chunk, cid)

    def prompt_rows(self, layout: PromptLayout) -> int:
        return compressed_rows(layout, self.settings.block)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        def rows_of(seg: Segment):
            stored = self.rows(ctx, seg.chunk)
            return stored, stored.row_positions

        return compressed_prefill(ctx.adapter, layout, capacity, rows_of, ctx.pipeline)


@register("c2kv", C2KVSettings, suffix="extractor",
          summary="trained 4x-compressed C2KV rows of every chunk, nothing recomputed (c2kv:<extractor>)")
def _c2kv(settings: C2KVSettings) -> Method:
    return C2KVMethod(settings)
