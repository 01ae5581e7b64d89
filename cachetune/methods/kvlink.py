"""KVLink: full reuse of every chunk plus trained link tokens after each, computed at request time.

The link tokens (kvlink.links) are active tokens with learned embeddings, like uncached text: they see
the head, every earlier chunk and link, and their own chunk. Rows are in position order (the links
take positions of their own), so the default causal attention serves the prompt and decoding.

    kvlink              the bundled trained links of the engine's model (EngineConfig.kvlink_links)
    kvlink:step0        untrained links (EOS embeddings): what training buys
    kvlink:path/to/weights.safetensors
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachetune.config import EngineConfig
from cachetune.kvlink.links import LinkTokens, link_layout
from cachetune.methods.base import Method, MethodContext, TrainedMethod, MAX_COUNT, check_int, check_name, register
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.forward import forward_active
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader, Pipeline

ORDER = 120


@dataclass(frozen=True)
class KVLinkSettings:
    links: str = EngineConfig.kvlink_links  # "bundled", "step0" or a file
    count: int = 5  # link tokens per document; must be the file's (the KV budget reserves by it)

    def __post_init__(self) -> None:
        check_name("links", self.links)
        check_int("count", self.count, maximum=MAX_COUNT)


@torch.no_grad()
def link_prefill(adapter: ModelAdapter, layout: PromptLayout, links: LinkTokens, capacity: int,
                 pipeline: Pipeline = Pipeline()) -> Prefill:
    """Chunks reused as they are (keys rotated at their shifted rows), links and uncached text computed."""
    segs = layout.segments
    count = links.config.count
    reused, link_rows, text, total = link_layout([int(s.token_ids.numel()) for s in segs],
                                                 [s.cached for s in segs], count)
    device = adapter.device
    parts = [(segs[i].chunk, torch.arange(segs[i].chunk.num_tokens),
              torch.arange(row, row + segs[i].chunk.num_tokens)) for i, row in reused]
    text_rows = [torch.arange(row, row + segs[i].token_ids.numel()) for i, row in text]
    text_ids = torch.cat([segs[i].token_ids for i, _ in text]).to(device)
    rows = torch.cat([*text_rows, link_rows])
    hidden = torch.cat([adapter.embed(text_ids), links.embedding.to(adapter.dtype).repeat(len(reused), 1)])
    order = torch.argsort(rows)  # forward_active wants rows in increasing order
    cache = KVCache.empty(adapter.num_layers, max(capacity, total), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    with LayerLoader(parts, adapter.kv_shape, device, adapter.dtype, pipeline) as loader:
        out = forward_active(adapter, hidden[order.to(device)], rows[order].to(device), cache, reused=loader,
                             last_only=True)
    return Prefill(cache, adapter.logits(out[-1:])[0], layout.total, int(rows.numel()), 0, prompt_rows=total,
                   reused_rows=int(loader.rows.numel()))


class KVLinkMethod(TrainedMethod):
    kind, weights_setting = LinkTokens, "links"

    def __init__(self, settings: KVLinkSettings):
        self.settings = settings

    def check(self, loaded) -> None:
        count = loaded.tokens.config.count
        if count != self.settings.count:
            raise ValueError(f"links {self.settings.links!r} have {count} tokens per document, "
                             f"not {self.settings.count}; pass count={count}")

    def prepare(self, ctx: MethodContext, chunk) -> None:
        self.loaded(ctx)  # nothing derived per chunk: the links are computed per request

    def prompt_rows(self, layout: PromptLayout) -> int:
        return layout.total + self.settings.count * len(layout.chunk_segments)

    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        return link_prefill(ctx.adapter, layout, self.loaded(ctx).tokens, capacity, ctx.pipeline)


@register("kvlink", KVLinkSettings, suffix="links",
          summary="every chunk reused as is, plus 5 trained link tokens after each (kvlink:<links>)")
def _kvlink(settings: KVLinkSettings) -> Method:
    return KVLinkMethod(settings)
