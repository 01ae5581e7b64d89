"""`cachetune c2kv eval`: C2KV next to its controls and the reuse methods, on the held-out HotpotQA
split and the evaluation sets, with gold-answer NLL, the gap it closes, KV bytes and composition.

Per dataset and method (harness records with gold NLL): answer NLL, gap closed = (NLL_no_context -
NLL_method) / (NLL_no_context - NLL_full_recompute), KL and top-1 agreement to full recompute, F1, TTFT,
KV loaded per document token (rows read from the store) and stored per document token (the exact
bytes of the store's file for that KV, header included). Composition: the same examples with the
documents shuffled; a method that composes changes its NLL no more than full recompute does.
"""

from __future__ import annotations

import torch

from cachetune.chunks.encode import EncodedChunk, chunk_id
from cachetune.eval.datasets import QAExample, load_split
from cachetune.methods.c2kv import encode_c2kv
from cachetune.store.blob import pack

DEFAULT_METHODS = ("full_recompute,c2kv,c2kv:paper,c2kv:step0,c2kv:step0+anchor,keep_every_4th,block_mean_4,kvlink,"
                   "block_attention,full_reuse,cachetune,epic,cacheblend")
SHUFFLED = "shuffled"


def heldout_examples(limit: int | None = None) -> list[QAExample]:
    """The held-out HotpotQA rows of the training set's fixed split (training never reads them)."""
    rows = load_split().heldout
    return rows[:limit] if limit is not None else rows


def stored_bytes_per_token(engine, examples: list[QAExample], extractor: str) -> dict:
    """File bytes per document token of what each kind of method keeps in the store: the full chunk
    KV (cachetune and every selective method) and the C2 rows (c2kv), over the examples' documents."""
    loaded = engine.extractors.get(extractor)
    full = c2 = tokens = 0
    for ex in examples:
        for doc in ex.documents:
            chunk = engine.chunk(engine.cache_document(doc))
            rows = torch.arange(chunk.num_tokens)
            kv = [chunk.load_layer(layer, rows) for layer in range(engine.adapter.num_layers)]
            encoded = EncodedChunk(chunk.chunk_id, chunk.token_ids, torch.stack([k for k, _ in kv]),
                                   torch.stack([v for _, v in kv]), chunk.ranking, chunk.scores, chunk.ranker)
            full += len(pack(encoded, engine.fingerprint))
            cid = chunk_id(engine.fingerprint, chunk.token_ids, loaded.variant)
            c2 += len(pack(encode_c2kv(engine.context, loaded, chunk, cid), engine.fingerprint))
            tokens += chunk.num_tokens
    return {"document_tokens": tokens, "full_chunk_bytes_per_token": full / tokens,
            "c2kv_bytes_per_token": c2 / tokens, "c2kv_over_full": c2 / full}


def composition_rows(summary: dict, dataset: str) -> list[dict]:
    """Per method: mean NLL in dataset order and shuffled, and the change (from the two summaries)."""
    base, shuffled = summary.get(dataset), summary.get(f"{dataset}/{SHUFFLED}")
    if base is None or shuffled is None:
        return []
    after = {r["method"]: r for r in shuffled["results"]}
    return [{"method": r["method"], "nll": r["nll"], "nll_shuffled": after[r["method"]]["nll"],
             "change": after[r["method"]]["nll"] - r["nll"]}
            for r in base["results"] if "nll" in r and r["method"] in after]


def format_c2kv_tables(report: dict) -> str:
    """The side-by-side table per dataset, the storage line and the composition table."""
    parts = [f"model {report['model']} ({report['dtype']}, {report['threads']} threads); "
             f"C2KV extractor {report['extractor']}"]
    storage = report.get("storage")
    if storage:
        parts.append(f"stored per document token: full chunk KV {storage['full_chunk_bytes_per_token'] / 1024:.1f} KiB, "
                     f"C2KV {storage['c2kv_bytes_per_token'] / 1024:.2f} KiB ({storage['c2kv_over_full']:.3f}x), "
                     f"headers included, over {storage['document_tokens']} document tokens")
    cols = ["method", "nll", "gap_closed", "kl_to_full", "top1_agree", "quality", "ttft_ms_median",
            "speedup_vs_full", "loaded_kib_per_doc_token"]
    for name, ds in report["datasets"].items():
        if name.endswith(f"/{SHUFFLED}"):
            continue
        parts += ["", f"### {name}: {ds['n_examples']} examples, ~{ds['mean_prompt_tokens']:.0f} prompt tokens, "
                      f"quality = {ds['metric']}, no-context NLL {ds['results'][0].get('no_context_nll', float('nan')):.3f}",
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in ds["results"]:
            parts.append("| " + " | ".join(_cell(row.get(c, float("nan"))) for c in cols) + " |")
        comp = composition_rows(report["datasets"], name)
        if comp:
            parts += ["", f"Composition ({name}, documents shuffled): NLL of the gold answer", "",
                      "| method | in order | shuffled | change |", "|---|---|---|---|"]
            parts += [f"| {r['method']} | {r['nll']:.3f} | {r['nll_shuffled']:.3f} | {r['change']:+.3f} |" for r in comp]
    return "\n".join(parts)


def _cell(value) -> str:
    if isinstance(value, str):
        return value
    if value != value:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"
