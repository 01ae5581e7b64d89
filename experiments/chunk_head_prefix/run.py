"""`cachetune eval` with every chunk encoded behind the prompt head instead of alone.

The prompt head is what a request puts before its documents (template start and the default system
prompt), the same text the `probe_head` ranker encodes chunks behind. A chunk encoded behind it sees
the head's tokens as its attention sink, as it will in a real prompt, instead of making its own first
tokens one. The encoding lives here, not in the package: it was measured and not kept (README.md).

    python experiments/chunk_head_prefix/run.py [--behind-head] [--deep-start-share S] eval <cachetune eval flags>
"""

from __future__ import annotations

import argparse
import sys

import torch

import cachetune.chunks.encode as encode
import cachetune.engine.chunk_cache as chunk_cache
import cachetune.methods.cachetune as cachetune_method
from cachetune.chunks.kv import encode_kv
from cachetune.chunks.rankers import ChunkView
from cachetune.chunks.ranking import ranking_from_scores
from cachetune.cli import main


def encode_behind_head(self, token_ids: torch.Tensor) -> encode.EncodedChunk:
    """ChunkCache._encode with the chunk's K/V computed after the prompt head (probe 0)."""
    self.encoded += 1
    ranker = self.rankings.ranker()
    context = self.rankings.context()
    ids = token_ids.to(self.adapter.device, torch.int64)
    keys, values = (x.cpu() for x in encode_kv(self.adapter, ids, context.probes.probe(0)))
    scores = ranker.scores(ChunkView(ids.cpu(), keys, values, context if ranker.needs_model else None))
    return encode.EncodedChunk(encode.chunk_id(self.fingerprint, ids), ids.cpu(), keys, values,
                               ranking_from_scores(scores), scores, ranker.name)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--behind-head", action="store_true", help="encode every chunk behind the prompt head")
    p.add_argument("--deep-start-share", type=float, help="deep focus's share of the budget on chunk starts")
    args, rest = p.parse_known_args()
    if args.behind_head:
        encode.ENCODING_VERSION += ":behind-head"  # chunk ids never match the package's encoding
        chunk_cache.ChunkCache._encode = encode_behind_head
    if args.deep_start_share is not None:
        cachetune_method.DEEP_START_SHARE = args.deep_start_share
    sys.exit(main(rest))
