"""TTFT of reuse against full recompute on model shapes too large for the CPUs here, by storage tier.

Weights are random (initialised on the device, so no checkpoint has to travel): only timings are
meaningful, never the outputs. Per shape: a prompt of CHUNKS cached chunks of CHUNK_TOKENS tokens plus
a question, served by full recompute, full reuse (r=0) and the top 15% of each chunk by its stored
ranking, with the chunk KV in GPU memory or in pinned CPU RAM, under every step of the cache-loading
ablation (eval.bench_pipeline.VARIANTS: sequential, +overlap, +sparse, +deferred_rope). Writes JSON
and a markdown table. Usage: python experiments/gpu_ttft_by_model_size/gpu_ttft.py OUT_DIR [--device cuda]
[--shapes smollm2-135m,qwen2.5-1.5b,llama3-8b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from cachetune.chunks.encode import encode_chunk
from cachetune.chunks.ranking import top_share
from cachetune.eval.bench_pipeline import VARIANTS
from cachetune.runtime.layout import PromptLayout, Segment
from cachetune.runtime.prefill import full_prefill, selective_prefill
from cachetune.model.adapter import ModelAdapter
from cachetune.store.memory import MemoryStore

CHUNKS, CHUNK_TOKENS, QUESTION_TOKENS, RATIO = 20, 300, 32, 0.15
SHAPES = {  # the public configs' shapes (vocabularies included: the last projection costs time too)
    "tiny": lambda: LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": lambda: LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                        rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-1.5b": lambda: Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                        rope_theta=1000000.0),
    "llama3-8b": lambda: LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     rope_theta=500000.0),
}


def _time(fn, device: torch.device, repeats: int = 5) -> float:
    """Median wall time in ms after two warm-up calls (the GPU queue is drained before each reading)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        int(torch.argmax(fn().logits))
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


@torch.no_grad()
def measure(shape: str, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=dtype).eval()
    adapter = ModelAdapter(model)
    vocab = model.config.vocab_size
    ids = [torch.randint(3, vocab, (CHUNK_TOKENS,)) for _ in range(CHUNKS)]
    question = torch.randint(3, vocab, (QUESTION_TOKENS,))
    encoded = [encode_chunk(adapter, t, "timing") for t in ids]
    row: dict = {"shape": shape, "prompt_tokens": CHUNKS * CHUNK_TOKENS + QUESTION_TOKENS}
    pinned = device.type == "cuda"
    tiers = [("cpu", MemoryStore(pinned=pinned))] + ([("gpu", MemoryStore(device=device))] if pinned else [])
    for tier, store in tiers:
        for chunk in encoded:
            store.put(chunk)
        layout = PromptLayout([Segment(c.token_ids, store.get(c.chunk_id)) for c in encoded] + [Segment(question)])
        if "full_recompute_ms" not in row:
            row["full_recompute_ms"] = _time(lambda: full_prefill(adapter, layout, layout.total), device)
        ranked = [top_share(seg.chunk.ranking, RATIO).sort().values for _, seg in layout.chunk_segments]
        for label, chosen in (("reuse", [torch.empty(0, dtype=torch.int64)] * CHUNKS), ("ranked15", ranked)):
            for variant, pipeline in VARIANTS.items():
                run = lambda: selective_prefill(adapter, layout, chosen, layout.total, pipeline)  # noqa: E731
                row[f"{label}_{tier}_{variant.lstrip('+')}_ms"] = _time(run, device)
    full = row["full_recompute_ms"]
    row["speedup"] = {key[:-3]: round(full / value, 2) for key, value in row.items()
                      if key.endswith("_ms") and key != "full_recompute_ms"}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b,llama3-8b")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        rows.append(measure(shape, device, dtype))
        print(json.dumps(rows[-1]), flush=True)
        (out / "gpu_ttft.json").write_text(json.dumps({"device": str(device), "dtype": args.dtype, "rows": rows}, indent=1))
    names = [k for k in rows[0]["speedup"]]
    lines = ["| shape | prompt | full recompute ms | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[n + '_ms']:.1f} ({r['speedup'][n]}x)" for n in names]
        lines.append(f"| {r['shape']} | {r['prompt_tokens']} | {r['full_recompute_ms']:.1f} | " + " | ".join(cells) + " |")
    (out / "gpu_ttft.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
