"""Full recompute and prefix reuse: the two methods whose KV is exactly the model's own.

`full_recompute` is what a user runs without reuse (the model's own forward over the whole prompt);
every speedup is measured against it. `prefix` reuses the longest cached prefix of the prompt
(vLLM-style block hashes) and computes the rest. Like vLLM's automatic prefix caching, both remember
the prompts they served in the prefix cache; approximate KV of a reuse method never goes in.
"""

from __future__ import annotations

from cachetune.methods.base import Method, MethodContext, NoSettings, register
from cachetune.runtime.layout import PromptLayout
from cachetune.runtime.prefill import Prefill, full_prefill, prefix_prefill
from cachetune.runtime.kv_cache import KVCache

FULL_RECOMPUTE = "full_recompute"
PREFIX = "prefix"
ORDER = 10  # first: every other method is measured against full recompute


class ExactMethod(Method):
    reuses_kv = False  # its KV is the model's own: allowed even where the self-check refused reuse

    def __init__(self, settings: NoSettings):
        self.settings = settings

    def finish(self, ctx: MethodContext, layout: PromptLayout, cache: KVCache) -> None:
        ctx.prefix_cache.insert(layout.input_ids, cache)


@register(FULL_RECOMPUTE, summary="everything: the model's own forward (every speedup is against it)")
class FullRecompute(ExactMethod):
    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        return full_prefill(ctx.adapter, layout, capacity)


@register(PREFIX, summary="everything after the longest cached prefix (vLLM-style block hashes; lossless)")
class PrefixReuse(ExactMethod):
    def prefill(self, ctx: MethodContext, layout: PromptLayout, capacity: int) -> Prefill:
        return prefix_prefill(ctx.adapter, layout, ctx.prefix_cache, capacity)
