"""Automatic prefix caching, as vLLM does it: reuse the longest cached prefix of a prompt, losslessly.

KV is kept in full blocks of `block_size` tokens. A block is keyed by a hash chained over every token
before it, so a block only matches where its whole prefix matches; a hit is confirmed by comparing
token ids (a hash collision never reuses wrong KV). Keys are kept rotated: a prefix always sits at
the same positions, so nothing needs re-rotation. Only full blocks are cached, and the last prompt
token is always recomputed (its logits are needed), as in vLLM.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cachetune.runtime.kv_cache import KVCache


def chained_block_hashes(token_ids: torch.Tensor, block_size: int, blocks: int) -> list[bytes]:
    """Key of each of the first `blocks` full blocks: a sha256 over the block's ids chained to its parent's."""
    out, parent = [], b""
    ids = token_ids.to(torch.int64).cpu()
    for b in range(blocks):
        chunk = ids[b * block_size:(b + 1) * block_size].numpy().tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        out.append(parent)
    return out


@dataclass
class _Block:
    token_ids: torch.Tensor  # [block_size]
    keys: torch.Tensor       # [layers, block_size, kv_heads, head_dim], rotated at their positions
    values: torch.Tensor


class PrefixCache:
    """An LRU pool of KV blocks keyed by chained token hashes (one model, one dtype)."""

    def __init__(self, block_size: int = 16, max_blocks: int = 65536):
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, token_ids: torch.Tensor) -> int:
        """Tokens of the longest cached prefix usable for this prompt (a multiple of block_size)."""
        return len(self._matched_blocks(token_ids)) * self.block_size

    def _matched_blocks(self, token_ids: torch.Tensor) -> list[_Block]:
        usable = (token_ids.numel() - 1) // self.block_size  # the last token is always computed
        found = []
        for b, key in enumerate(chained_block_hashes(token_ids, self.block_size, usable)):
            block = self._blocks.get(key)
            span = token_ids[b * self.block_size:(b + 1) * self.block_size].cpu()
            if block is None or not torch.equal(block.token_ids, span):
                break
            self._blocks.move_to_end(key)
            found.append(block)
        return found

    def lookup(self, token_ids: torch.Tensor) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """(m, keys, values) of the longest cached prefix: keys/values [layers, m, Hkv, D] or None."""
        blocks = self._matched_blocks(token_ids)
        if not blocks:
            return 0, None, None
        keys = torch.cat([b.keys for b in blocks], dim=1)
        values = torch.cat([b.values for b in blocks], dim=1)
        return len(blocks) * self.block_size, keys, values

    def insert(self, token_ids: torch.Tensor, cache: KVCache) -> None:
        """Remember the full blocks of a prompt whose KV fills rows [0, len(token_ids)) of `cache`."""
        blocks = min(token_ids.numel(), cache.length) // self.block_size
        for b, key in enumerate(chained_block_hashes(token_ids, self.block_size, blocks)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            rows = slice(b * self.block_size, (b + 1) * self.block_size)
            self._blocks[key] = _Block(
                token_ids[rows].cpu().clone(), cache.keys[:, rows].clone(), cache.values[:, rows].clone()
            )
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
