"""The layer driver: every forward cachetune runs goes through `forward_active` or `decode_step`.

`forward_active` runs one request's active tokens through all layers while the rest of its KV comes
from elsewhere. It serves chunk encoding (every token active, no reused KV), selective prefill
(selected chunk tokens and uncached text active, the rest reused), APE (rows that share positions,
with its own attention) and teacher-forced decoding. At each layer:

1. reused K/V for the layer (pre-RoPE keys, loaded while the previous layer computed) are rotated at
   the positions of their rows and written into the KVCache;
2. active tokens get fresh Q/K/V from their current hidden states; K is rotated and written too;
3. active queries attend over the rows before them (causal in row order by default);
4. output projection and MLP update the active hidden states, which feed the next layer.

`decode_step` advances many requests by one token together: projections, MLP and head run once on
the stacked tokens [B, hidden] (the weights are read once per step, which is what batching buys on a
memory-bound decode), while each request writes its own KV row and attends over its own cache.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, Protocol, Sequence

import torch

from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.attention import decode_attention, plan_blocks, sparse_causal_attention
from cachetune.runtime.kv_cache import KVCache


class ReusedKV(Protocol):
    """Source of reused KV, one layer at a time (see cachetune.runtime.loading)."""

    rows: torch.Tensor  # [R] KV rows they fill (their positions are the cache's positions of those rows)

    def begin(self, rotate: Callable[[int, torch.Tensor], torch.Tensor]) -> bool:
        """Called once before layer(0); rotate(layer, keys [R, Hkv, D]) applies RoPE at the rows'
        positions. True: layer() returns keys already rotated with it (deferred RoPE on the loading
        path); False: they come pre-RoPE and the forward rotates them."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys (pre-RoPE unless begin() said otherwise) and values [R, Hkv, D] of layer `index`,
        in `rows` order; None when that layer's rows are in the cache already (a pass before
        filled them)."""


CaptureFn = Callable[[int, torch.Tensor, torch.Tensor], None]
# observe(layer, q [T, H, D] rotated, keys [end, Hkv, D] rotated): sees every active query and the
# layer's complete keys just before attention (ProphetKV scores context tokens with it).
ObserveFn = Callable[[int, torch.Tensor, torch.Tensor], None]
# fuse(layer, k, v) -> (k, v): rewrites the active tokens' fresh pre-RoPE K/V before they are cached.
FuseFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# attention(layer, q [T, Hq, D] rotated, cache, rows [T]) -> [T, Hq, D]: queries written at `rows`
# over the cache rows [0, rows[-1]] (a method's own rule; the default is causal in row order).
AttentionFn = Callable[[int, torch.Tensor, KVCache, torch.Tensor], torch.Tensor]


class PromptHidden:
    """The final hidden states of the tokens a prefill computed (before the final norm), kept for
    prompt logprobs (`keeping_prompt_hidden`): `hidden` [T, hidden] at KV `rows` [T], from `adapter`.

    A prefill may run several full forwards (a signal pass, then the prefill proper); the last one
    wins, and the prefill proper is always the last."""

    def __init__(self) -> None:
        self.adapter: ModelAdapter | None = None
        self.rows: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def keep(self, adapter: ModelAdapter, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        self.adapter, self.rows, self.hidden = adapter, rows, hidden


_PROMPT_HIDDEN: ContextVar[PromptHidden | None] = ContextVar("cachetune_prompt_hidden", default=None)


@contextlib.contextmanager
def keeping_prompt_hidden() -> Iterator[PromptHidden]:
    """Within the block, full forwards keep every computed token's final hidden state (they run the
    last layer for all tokens instead of the last one alone) and hand it to the yielded PromptHidden."""
    sink = PromptHidden()
    token = _PROMPT_HIDDEN.set(sink)
    try:
        yield sink
    finally:
        _PROMPT_HIDDEN.reset(token)


def prompt_hidden_sink() -> PromptHidden | None:
    """The PromptHidden of the enclosing `keeping_prompt_hidden` block, or None outside one."""
    return _PROMPT_HIDDEN.get()


def forward_active(
    adapter: ModelAdapter,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    cache: KVCache,
    reused: ReusedKV | None = None,
    capture: CaptureFn | None = None,
    last_only: bool = False,
    observe: ObserveFn | None = None,
    layers: range | None = None,
    fuse: FuseFn | None = None,
    attention: AttentionFn | None = None,
    last_output: bool = True,
) -> torch.Tensor:
    """Run layers for the active tokens and fill `cache` up to max(rows) + 1.

    hidden: [T, hidden] embeddings of the active tokens; rows: [T] strictly increasing KV rows they
    write; their positions are `cache.positions[rows]` (set them first when rows are not positions).
    `reused` must cover every row below max(rows) that is neither active nor already in `cache`.
    `capture(layer, k_pre_rope, v)` receives the active tokens' fresh K/V (chunk encoding stores these).
    Returns the active tokens' final hidden states [T, hidden], or only the last one [1, hidden] with
    `last_only`: the final layer still writes every active token's K/V (decoding needs them) but runs
    attention and MLP for the last token alone, since nothing reads the other outputs.
    `layers` runs a contiguous sub-range (default all): `hidden` must then be the input of its first
    layer, and the output is that of its last (CacheBlend's check layer runs layer 0 alone).
    `attention` replaces the default causal attention (APE). `last_output` False: the last of
    `layers` only writes its K/V and calls `observe` (a pass that observes reads no output from it),
    and the result is that layer's input.
    The cache may hold another dtype than the adapter computes in (a signal pass on cast layers over
    a float32 cache): K/V are cast as they are written and attention runs in the cache's dtype, so
    reused rows stay exact for a prefill that continues from the cache.
    """
    end = int(rows[-1]) + 1
    cache.ensure_capacity(end)
    layers = layers if layers is not None else range(adapter.num_layers)
    last = adapter.num_layers - 1
    sink = _PROMPT_HIDDEN.get()
    keep = sink is not None and last_output and layers[0] == 0 and layers[-1] == last
    wanted_last_only, last_only = last_only, last_only and not keep
    # Everything that depends only on positions is computed once, not per layer.
    rr = reused.rows if reused is not None and reused.rows.numel() else None
    kv_dtype = cache.keys.dtype
    active_rope = adapter.rope_tables(cache.positions[rows])
    reused_rope = adapter.rope_tables(cache.positions[rr], kv_dtype) if rr is not None else {}
    groups = adapter.num_heads // adapter.num_kv_heads
    plan = plan_blocks(rows, groups, kv_dtype) if attention is None else None
    last_rows = rows[-1:] if last_only else rows
    last_plan = plan_blocks(last_rows, groups, kv_dtype) if last_only and attention is None else plan

    def rotate_reused(layer: int, keys: torch.Tensor) -> torch.Tensor:
        return adapter.rotate(keys, *reused_rope[adapter.layer_info[layer].rope_kind])

    rotated = reused.begin(rotate_reused) if rr is not None else False
    for layer in layers:
        info = adapter.layer_info[layer]
        loaded = reused.layer(layer) if rr is not None else None
        if loaded is not None:
            rk, rv = loaded
            cache.keys[layer].index_copy_(0, rr, rk if rotated else rotate_reused(layer, rk))
            cache.values[layer].index_copy_(0, rr, rv)
        q, k, v = adapter.project_qkv(layer, hidden)
        if capture is not None:
            capture(layer, k, v)
        if fuse is not None:
            k, v = fuse(layer, k, v)
        qcos, qsin = active_rope[info.rope_kind]
        q = adapter.rotate(q, qcos, qsin).to(kv_dtype)
        cache.keys[layer].index_copy_(0, rows, adapter.rotate(k, qcos, qsin).to(kv_dtype))
        cache.values[layer].index_copy_(0, rows, v.to(kv_dtype))
        if observe is not None:
            observe(layer, q, cache.keys[layer, :end])
        if layer == layers[-1] and not last_output:
            break
        q_rows, layer_plan = rows, plan
        if layer == last and last_only:
            q, hidden, q_rows, layer_plan = q[-1:], hidden[-1:], last_rows, last_plan
        if attention is not None:
            attn = attention(layer, q, cache, q_rows)
        elif adapter.attention_kernel is not None:
            attn = adapter.attention_kernel(layer, q, cache.keys[layer, :end], cache.values[layer, :end], q_rows,
                                            info.scale, info.sliding_window, layer_plan)
        else:
            attn = sparse_causal_attention(
                q, cache.keys[layer, :end], cache.values[layer, :end], q_rows, info.scale, info.sliding_window,
                plan=layer_plan,
            )
        hidden = adapter.finish_layer(layer, hidden, attn.to(hidden.dtype))
    cache.length = max(cache.length, end)
    if keep:
        sink.keep(adapter, rows, hidden)
        return hidden[-1:] if wanted_last_only else hidden
    return hidden


@torch.no_grad()
def decode_step(
    adapter: ModelAdapter,
    token_ids: Sequence[int],
    caches: Sequence[KVCache],
    attentions: Sequence[AttentionFn | None] | None = None,
) -> torch.Tensor:
    """Append one token to each request's cache; returns their next-token logits [B, vocab] (float32).

    token_ids[b] goes to caches[b] at row caches[b].length and position caches[b].next_position().
    attentions[b] (None: causal over every earlier row) is request b's decode attention. Every row of
    the result depends only on its own request: a request decodes the same tokens alone or in a batch.
    """
    device = adapter.device
    batch = len(caches)
    attentions = attentions if attentions is not None else [None] * batch
    rows = []
    for cache in caches:
        row = cache.length
        cache.ensure_capacity(row + 1)
        cache.positions[row] = cache.next_position()
        rows.append(row)
    positions = torch.stack([c.positions[r] for c, r in zip(caches, rows)]).to(device)  # [B]
    tables = adapter.rope_tables(positions)
    hidden = adapter.embed(torch.tensor(list(token_ids), device=device))  # [B, hidden]
    for layer in range(adapter.num_layers):
        info = adapter.layer_info[layer]
        cos, sin = tables[info.rope_kind]
        q, k, v = adapter.project_qkv(layer, hidden)  # [B, H(kv), D]
        q = adapter.rotate(q, cos, sin)
        k = adapter.rotate(k, cos, sin)
        outs = []
        for b, (cache, row, attend) in enumerate(zip(caches, rows, attentions)):
            keys, values = cache.key_store[layer], cache.value_store[layer]  # [Hkv, capacity, D]
            keys[:, row] = k[b]
            values[:, row] = v[b]
            if attend is None:
                outs.append(decode_attention(q[b], keys[:, : row + 1], values[:, : row + 1], info.scale,
                                             info.sliding_window))
            else:
                outs.append(attend(layer, q[b : b + 1], cache, torch.tensor([row], device=device))[0])
        hidden = adapter.finish_layer(layer, hidden, torch.stack(outs))
    for cache, row in zip(caches, rows):
        cache.length = row + 1
    return adapter.logits(hidden)
