"""Prefill building blocks the methods share: the model's own full forward, selective recompute over
cached chunks, pruning, and reuse of an exact prefix. Each returns a `Prefill`."""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache

from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefix_cache import PrefixCache
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.decode import extend
from cachetune.runtime.forward import AttentionFn, FuseFn, ObserveFn, forward_active, prompt_hidden_sink
from cachetune.runtime.kv_cache import KVCache
from cachetune.runtime.loading import LayerLoader, LayerSource, Pipeline


class Prefill:
    """A filled KV cache (rows [0, prompt_rows), room left for decoding) and the next-token logits.

    `prompt_rows` equals `prompt_tokens` unless the method stores fewer or more rows than the prompt
    has tokens (compressed chunk KV, link tokens). `attention` is the decode attention of the method
    that made it (None: causal over all rows); `adapter` the model that decodes it (None: the engine's)."""

    def __init__(self, cache, logits: torch.Tensor, prompt_tokens: int, computed_tokens: int,
                 recomputed_chunk_tokens: int, capacity: int = 0, attention: AttentionFn | None = None,
                 prompt_rows: int | None = None, reused_rows: int = 0, adapter: ModelAdapter | None = None):
        self._cache = cache                # a KVCache, or a transformers cache converted on first use
        self._capacity = capacity
        self.logits = logits               # [vocab] float32, after the last prompt token
        self.prompt_tokens = prompt_tokens
        self.prompt_rows = prompt_tokens if prompt_rows is None else prompt_rows
        self.computed_tokens = computed_tokens              # tokens that went through the layers
        self.recomputed_chunk_tokens = recomputed_chunk_tokens  # of those, tokens of cached chunks
        self.reused_rows = reused_rows     # KV rows loaded from a store or prefix cache instead of computed
        self.attention = attention
        self.adapter = adapter  # the model that decodes this request (None: the engine's own)

    @property
    def cache(self) -> KVCache:
        # Full recompute's cache is copied into our layout only when decoding needs it, so the copy
        # is not charged to the baseline's time to first token.
        if not isinstance(self._cache, KVCache):
            self._cache = KVCache.from_hf(self._cache, self._capacity)
        return self._cache

    def extend(self, adapter: ModelAdapter, token_ids: list[int]) -> torch.Tensor:
        """Decode step(s): append tokens to the cache; returns their next-token logits [len, vocab].
        A method that serves with its own model (Block-Attention's fine-tune) decodes with it."""
        return extend(self.adapter or adapter, self.cache, token_ids, self.attention)


@torch.no_grad()
def full_prefill(adapter: ModelAdapter, layout: PromptLayout, capacity: int) -> Prefill:
    """What a user would run without reuse: one plain forward of the model over the whole prompt."""
    ids = layout.input_ids.to(adapter.device)
    # An explicit config-less DynamicCache keeps every row of every layer; the default cache would
    # drop rows outside a sliding window, which decoding from our cache still needs for other layers.
    sink = prompt_hidden_sink()
    keep = None if sink is None else adapter.backbone.norm.register_forward_pre_hook(
        lambda _, args: sink.keep(adapter, torch.arange(layout.total), args[0][0]))  # every token, before the norm
    try:
        out = adapter.model(input_ids=ids[None], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    finally:
        if keep is not None:
            keep.remove()
    n = layout.total
    chunk_tokens = sum(s.token_ids.numel() for _, s in layout.chunk_segments)
    return Prefill(out.past_key_values, out.logits[0, -1].float(), n, n, chunk_tokens, capacity)


def reuse_plan(layout: PromptLayout, selections: list[torch.Tensor]
               ) -> tuple[torch.Tensor, list[tuple[LayerSource, torch.Tensor, torch.Tensor]], int]:
    """(active prompt positions [T], loader parts (chunk, reused local indices, their rows), number of
    chunk tokens recomputed) of a selective prefill; selections as in selective_prefill."""
    chunks = layout.chunk_segments
    if len(selections) != len(chunks):
        raise ValueError(f"{len(selections)} selections for {len(chunks)} chunks")
    active = torch.ones(layout.total, dtype=torch.bool)
    parts = []
    recomputed = 0
    for (start, seg), chosen in zip(chunks, selections):
        n = seg.token_ids.numel()
        chosen = torch.unique(chosen)  # a set of local indices: order and repeats carry no meaning
        if chosen.numel() and (chosen[0] < 0 or chosen[-1] >= n):
            raise ValueError(f"selected local indices must lie in [0, {n})")
        recomputed += chosen.numel()
        reuse = torch.ones(n, dtype=torch.bool)
        reuse[chosen] = False
        local = reuse.nonzero().flatten()
        active[start + local] = False
        parts.append((seg.chunk, local, start + local))
    return active.nonzero().flatten(), parts, recomputed


class Prefilled:
    """A KVCache whose layers [0, layers) already hold every chunk row of the layout, stored K/V
    rotated at their positions (a signal pass over the fully reused chunks filled them)."""

    def __init__(self, cache: KVCache, layers: int):
        self.cache, self.layers = cache, layers


class _AfterPrefilled:
    """ReusedKV over a LayerLoader that skips the layers a Prefilled cache holds already."""

    def __init__(self, loader: LayerLoader, layers: int):
        self.loader, self.layers, self.rows = loader, layers, loader.rows

    def begin(self, rotate) -> bool:
        return self.loader.begin(rotate)

    def layer(self, index: int):
        return None if index < self.layers else self.loader.layer(index)


@torch.no_grad()
def selective_prefill(
    adapter: ModelAdapter,
    layout: PromptLayout,
    selections: list[torch.Tensor],
    capacity: int,
    pipeline: Pipeline = Pipeline(),
    observe: ObserveFn | None = None,
    fuse: FuseFn | None = None,
    prefilled: Prefilled | None = None,
) -> Prefill:
    """Recompute uncached text and the selected chunk tokens; reuse all other chunk KV.

    selections: per cached chunk (prompt order), sorted local indices to recompute.
    observe, fuse: passed to forward_active (see there). prefilled: a cache whose first layers hold
    the reused rows already; it becomes the result's cache, and only later layers are loaded (the
    result is the same as without it).
    """
    active_pos, parts, recomputed = reuse_plan(layout, selections)
    device = adapter.device
    ids = layout.input_ids[active_pos].to(device)
    if prefilled is not None:
        cache, skip = prefilled.cache, prefilled.layers
        cache.ensure_capacity(max(capacity, layout.total))
    else:
        cache, skip = KVCache.empty(adapter.num_layers, max(capacity, layout.total), adapter.num_kv_heads,
                                    adapter.head_dim, adapter.dtype, device), 0
    with LayerLoader(parts, adapter.kv_shape, device, adapter.dtype, pipeline) as loader:
        reused = _AfterPrefilled(loader, skip) if skip else loader
        hidden = forward_active(
            adapter, adapter.embed(ids), active_pos.to(device), cache, reused=reused, last_only=True,
            observe=observe, fuse=fuse,
        )
    logits = adapter.logits(hidden[-1:])[0]
    return Prefill(cache, logits, layout.total, int(active_pos.numel()), recomputed,
                   reused_rows=int(loader.rows.numel()))


@torch.no_grad()
def prefix_prefill(adapter: ModelAdapter, layout: PromptLayout, prefix_cache: PrefixCache,
                   capacity: int) -> Prefill:
    """Reuse the longest cached prefix (exact KV); compute everything after it in one forward.

    The suffix is one contiguous run of queries, which our attention serves with one causal call
    over the run plus one unmasked call over the prefix (merged exactly). HF's forward with the
    prefix as past KV would build an explicit [suffix, total] mask, which the CPU kernel serves at
    about half the speed of its causal path (measured: 80-85 s against 49-51 s on a 6.2K prompt)."""
    ids = layout.input_ids
    device = adapter.device
    cache = KVCache.empty(
        adapter.num_layers, max(capacity, layout.total), adapter.num_kv_heads, adapter.head_dim, adapter.dtype, device
    )
    hit, keys, values = prefix_cache.lookup(ids)
    if hit:
        cache.keys[:, :hit] = keys.to(device)
        cache.values[:, :hit] = values.to(device)
    cache.length = hit
    active_pos = torch.arange(hit, layout.total, device=device)
    hidden = forward_active(adapter, adapter.embed(ids[hit:].to(device)), active_pos, cache, last_only=True)
    logits = adapter.logits(hidden[-1:])[0]
    # Chunk tokens after the hit are recomputed; those inside it were reused.
    recomputed = sum(max(0, start + seg.chunk.num_tokens - max(start, hit)) for start, seg in layout.chunk_segments)
    return Prefill(cache, logits, layout.total, layout.total - hit, recomputed, reused_rows=hit)


@torch.no_grad()
def pruned_prefill(adapter: ModelAdapter, layout: PromptLayout, selections: list[torch.Tensor],
                   capacity: int) -> Prefill:
    """Keep only the selected tokens of each chunk, drop the rest from the prompt, run a full prefill.

    The kept tokens get consecutive positions (the dropped ones never existed for the model)."""
    kept = iter(selections)
    segments = [Segment(seg.token_ids[next(kept)]) if seg.cached else seg for seg in layout.segments]
    pruned = PromptLayout(segments)
    result = full_prefill(adapter, pruned, capacity)
    result.recomputed_chunk_tokens = sum(int(s.numel()) for s in selections)
    return result


# rows_of(chunk segment) -> (source of its rows, their local positions [R]) for compressed chunk KV.
RowsFn = Callable[[Segment], tuple[LayerSource, torch.Tensor]]


@torch.no_grad()
def compressed_prefill(adapter: ModelAdapter, layout: PromptLayout, capacity: int, rows_of: RowsFn,
                       pipeline: Pipeline = Pipeline()) -> Prefill:
    """Uncached text computed at its own positions; every chunk as reused rows at the positions
    `rows_of` gives (offset by the chunk's start), nothing recomputed.

    Positions are those of the full prompt: the question starts at the head's length plus the
    *original* lengths of the documents before it, however few rows they keep. Rows stay in
    non-decreasing position order, so the default causal attention applies here and in decoding."""
    if any(info.sliding_window is not None for info in adapter.layer_info):
        # Windows count rows as positions in the default attention; compressed rows break that.
        raise ValueError("compressed chunk KV does not support sliding-window attention yet")
    device = adapter.device
    active_rows, parts, positions = [], [], []
    row = 0
    for start, seg in zip(layout.starts, layout.segments):
        if seg.cached:
            source, local = rows_of(seg)
            pos = start + local
            parts.append((source, torch.arange(pos.numel()), torch.arange(row, row + pos.numel())))
        else:
            n = int(seg.token_ids.numel())
            pos = torch.arange(start, start + n)
            active_rows.append(torch.arange(row, row + n))
        positions.append(pos)
        row += pos.numel()
    cache = KVCache.empty(adapter.num_layers, max(capacity, row), adapter.num_kv_heads, adapter.head_dim,
                          adapter.dtype, device)
    cache.positions[:row] = torch.cat(positions).to(device)
    rows = torch.cat(active_rows).to(device)
    ids = torch.cat([s.token_ids for s in layout.segments if not s.cached]).to(device)
    with LayerLoader(parts, adapter.kv_shape, device, adapter.dtype, pipeline) as loader:
        hidden = forward_active(adapter, adapter.embed(ids), rows, cache, reused=loader, last_only=True)
    return Prefill(cache, adapter.logits(hidden[-1:])[0], layout.total, int(rows.numel()), 0, prompt_rows=row,
                   reused_rows=int(loader.rows.numel()))
