"""C2KV's student: answer logits over a prompt assembled from independently extracted C2KV.

One sample is laid out exactly as a request is served (methods/c2kv.py): the prompt head's KV
(template start + system prompt, computed by the frozen model), then each document's C2 rows rotated
at the document's start plus their block-end positions, then the question and the answer at their
full-prompt positions. Documents are encoded alone without autograd; only the C2Tokens' forward and
the question/answer forward carry gradients, and those reach only the extractor.
"""

from __future__ import annotations

import torch

from cachetune.c2kv.extractor import C2Extractor, extract_c2kv
from cachetune.model.adapter import ModelAdapter
from cachetune.runtime.dense import causal_after_context, dense_forward
from cachetune.train.objective import Sample, document_kv, rotate_layers


def c2kv_logits(adapter: ModelAdapter, extractor: C2Extractor, sample: Sample) -> torch.Tensor:
    """Next-token logits [len(question) + len(answer) - 1, vocab] predicting the tail (question + answer)
    after its first token over the C2KV-assembled prompt; the last len(answer) rows are the answer's."""
    device = adapter.device
    head_k, head_v = document_kv(adapter, sample.head)
    layers_k = [[k] for k in rotate_layers(adapter, head_k, torch.arange(sample.head.numel()))]
    layers_v = [[head_v[i]] for i in range(adapter.num_layers)]
    start = sample.head.numel()
    for doc in sample.documents:
        keys, values = document_kv(adapter, doc)
        c2_k, c2_v, local = extract_c2kv(adapter, extractor, doc, keys, values)
        for i, k in enumerate(rotate_layers(adapter, c2_k, start + local)):
            layers_k[i].append(k)
            layers_v[i].append(c2_v[i])
        start += doc.numel()  # the next document starts after this one's *original* length
    context_k = [torch.cat(k) for k in layers_k]
    context_v = [torch.cat(v) for v in layers_v]
    tail = torch.cat([sample.question, sample.answer]).to(device)
    positions = torch.arange(start, start + tail.numel(), device=device)
    visible = causal_after_context(context_k[0].shape[0], tail.numel(), device)
    hidden = dense_forward(adapter, adapter.embed(tail), positions, visible,
                           context=lambda layer: (context_k[layer], context_v[layer]))
    return adapter.logits(hidden[:-1])
