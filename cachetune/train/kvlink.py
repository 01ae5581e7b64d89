"""KVLink's student: answer logits over reused documents with trained link tokens after each.

Layout as served (methods/kvlink.py): the head's KV, then per document its own KV (encoded alone,
keys rotated at its start) followed by the link tokens; documents start after the earlier documents
*and* their links. The links, the question and the answer are the active tokens: causal over
everything before them. Gradients reach only the link embeddings.
"""

from __future__ import annotations

import torch

from cachetune.kvlink.links import LinkTokens
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.dense import dense_forward
from cachetune.train.objective import Sample, document_kv, rotate_layers


def kvlink_logits(adapter: ModelAdapter, links: LinkTokens, sample: Sample) -> torch.Tensor:
    """Next-token logits predicting tail[1:] (question + answer) over documents + link tokens (the
    objective's contract: the last len(answer) rows are the answer's)."""
    device = adapter.device
    count = links.config.count
    layers_k: list[list[torch.Tensor]] = [[] for _ in range(adapter.num_layers)]
    layers_v: list[list[torch.Tensor]] = [[] for _ in range(adapter.num_layers)]
    context_pos, active_pos, active_hidden = [], [], []
    start = 0
    for j, part in enumerate([sample.head, *sample.documents]):
        keys, values = document_kv(adapter, part)
        pos = torch.arange(start, start + part.numel())
        for i, k in enumerate(rotate_layers(adapter, keys, pos)):
            layers_k[i].append(k)
            layers_v[i].append(values[i])
        context_pos.append(pos)
        start += part.numel()
        if j > 0:  # links after every document, not after the head
            active_pos.append(torch.arange(start, start + count))
            active_hidden.append(links.embedding.to(adapter.dtype))
            start += count
    tail = torch.cat([sample.question, sample.answer]).to(device)
    active_pos.append(torch.arange(start, start + tail.numel()))
    active_hidden.append(adapter.embed(tail))
    ctx, act = torch.cat(context_pos), torch.cat(active_pos)
    # Causal by position: context rows before each active token, and active tokens up to itself.
    visible = torch.cat([ctx[None, :] < act[:, None], act[None, :] <= act[:, None]], dim=1).to(device)
    context_k = [torch.cat(k) for k in layers_k]
    context_v = [torch.cat(v) for v in layers_v]
    hidden = dense_forward(adapter, torch.cat(active_hidden), act.to(device), visible,
                           context=lambda layer: (context_k[layer], context_v[layer]))
    return adapter.logits(hidden[-tail.numel() : -1])
