"""`demo`: documents are cached once as they arrive; later a question comes with them in a new order.
Full recompute and cachetune answer it side by side: both answers, the time to first token of each,
the speedup, and how far cachetune's next-token distributions are from full recompute's over full
recompute's answer (teacher-forced, as `cachetune eval` measures fidelity)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from cachetune.cli.common import engine, engine_args

# The built-in example: short encyclopedic documents (written for this demo) and a question one of
# them answers, which the bundled 135M model answers from them.
DOCUMENTS = [
    "Mount Kilimanjaro is a dormant volcano in Tanzania, close to the border with Kenya. Its highest peak, "
    "Uhuru Peak on the Kibo cone, rises 5,895 metres above sea level, which makes it the highest mountain in "
    "Africa and the highest free-standing mountain in the world. The mountain has three volcanic cones: Kibo, "
    "Mawenzi and Shira. The German geographer Hans Meyer and the Austrian climber Ludwig Purtscheller were the "
    "first people recorded to reach the summit, in October 1889. Climbers pass through five climate zones on "
    "the way up, from farmland and rainforest to alpine desert and the glaciers of the summit, which have "
    "shrunk by more than eighty percent since the early twentieth century. Kilimanjaro National Park, "
    "established in 1973, protects the mountain above the tree line and is a UNESCO World Heritage Site.",
    "The Amazon is the largest river in the world by the volume of water it carries. It rises in the Andes of "
    "Peru and flows east across Brazil for about 6,400 kilometres before it reaches the Atlantic Ocean, and "
    "its basin also covers parts of Colombia, Ecuador, Bolivia, Venezuela and Guyana. The river discharges "
    "around 209,000 cubic metres of water per second, more than the next seven largest rivers combined. No "
    "bridge crosses the main stream of the Amazon, because most of its course runs through rainforest with "
    "few roads and its banks shift from season to season. The Spanish explorer Francisco de Orellana made the "
    "first known descent of the river by Europeans in 1542. The rainforest of the basin is home to about ten "
    "percent of the species known on Earth.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It was designed "
    "and built by the company of the engineer Gustave Eiffel as the entrance arch of the 1889 World's Fair, "
    "which marked the hundredth anniversary of the French Revolution. The tower is 330 metres tall and was the "
    "tallest man-made structure in the world until the Chrysler Building in New York was completed in 1930. "
    "Many artists of the time criticised the design, and the tower was meant to stand for only twenty years, "
    "but it was kept because it proved useful as a radio transmission mast. Today it has three levels open "
    "to visitors, with restaurants on the first and second, and it welcomes around six million visitors a "
    "year.",
    "Marie Curie was a Polish and naturalised French physicist and chemist who carried out pioneering research "
    "on radioactivity. Born Maria Sklodowska in Warsaw in 1867, she moved to Paris in 1891 to study at the "
    "Sorbonne, where she met the physicist Pierre Curie, whom she married in 1895. In 1903 she shared the "
    "Nobel Prize in Physics with Pierre Curie and Henri Becquerel, and in 1911 she received the Nobel Prize in "
    "Chemistry for the discovery of the elements polonium and radium. She was the first woman to win a Nobel "
    "Prize and remains the only person to have won Nobel Prizes in two different sciences. During the First "
    "World War she developed mobile X-ray units that treated wounded soldiers near the front. She died in "
    "1934 of aplastic anaemia, probably caused by her long exposure to radiation.",
    "The Rosetta Stone is a slab of dark granodiorite inscribed with a decree issued in Memphis, Egypt, in 196 "
    "BC on behalf of King Ptolemy V. The decree appears three times: in Ancient Egyptian hieroglyphs, in "
    "Demotic script and in Ancient Greek. Because the three texts say nearly the same thing, the stone became "
    "the key to deciphering Egyptian hieroglyphs. French soldiers found it in 1799 near the town of Rashid, "
    "known in English as Rosetta, during Napoleon's campaign in Egypt. After the French surrender it was taken "
    "to Britain, and it has been on display in the British Museum in London since 1802. The French scholar "
    "Jean-Francois Champollion announced the first decipherment of the hieroglyphic text in 1822.",
]
QUESTION = "Where is the Rosetta Stone displayed today?"
ANSWERS = ["the British Museum", "British Museum in London"]
ORDERS = ("reversed", "shuffled", "same")


def demo_example(index: int | None = None, docs: int = 0, order: str = "reversed", question: str | None = None):
    """(the example as its documents were first cached, the example as the question brings them).

    `index` None is the built-in example, else that row of the bundled MuSiQue sample; `docs` keeps
    the first N documents (0: all); `question` replaces the example's (no gold answer then)."""
    from cachetune.eval.datasets import QAExample, bundled_sample_path, load_dataset

    if index is None:
        first = QAExample("builtin", list(DOCUMENTS), QUESTION, list(ANSWERS))
    else:
        examples = load_dataset(str(bundled_sample_path()))
        if not 0 <= index < len(examples):
            raise ValueError(f"--example must be in 0..{len(examples) - 1}, got {index}")
        first = examples[index]
    if docs:
        first = replace(first, documents=first.documents[:docs])
    if question:
        first = replace(first, question=question, answers=[])
    documents = list(first.documents)
    if order == "reversed":
        documents.reverse()
    elif order == "shuffled":
        g = torch.Generator().manual_seed(len(documents))
        documents = [documents[i] for i in torch.randperm(len(documents), generator=g)]
    return first, replace(first, documents=documents)


def run_demo(eng, first, asked, max_new_tokens: int = 32, repeats: int = 1) -> dict:
    """Cache `first`'s documents, warm up, then serve `asked` with full recompute and the engine's
    default method; returns the report (answers, TTFT, speedup, KL and top-1 agreement to full)."""
    from cachetune.eval.harness import Variant, prepare, run_example
    from cachetune.methods.full_recompute import FULL_RECOMPUTE

    method, ratio = eng.config.method, eng.config.ratio
    variants = [Variant(FULL_RECOMPUTE, FULL_RECOMPUTE, ratio), Variant(method, method, ratio)]
    start = time.perf_counter()
    for doc in first.documents:  # each encoded alone, once, and stored: what a later request reuses
        eng.cache_document(doc)
    encode_ms = (time.perf_counter() - start) * 1000
    # The first forward of a process is slow (thread pools, allocations): one short untimed request each.
    warm = prepare(eng, replace(asked, documents=asked.documents[:1]), variants, max_new_tokens=1)
    for variant in variants:
        warm.start(variant, 1)
    scored = asked if asked.answers else replace(asked, answers=[""])  # the harness scores against gold
    req = prepare(eng, scored, variants, max_new_tokens=max_new_tokens)  # every document is a cache hit
    record = run_example(eng, req, variants, "demo", repeats)
    rows = {}
    full_ttft = statistics.median(record["methods"][FULL_RECOMPUTE]["ttft_ms"])
    for variant in variants:
        r = record["methods"][variant.label]
        ttft = statistics.median(r["ttft_ms"])
        rows[variant.label] = {
            "answer": r["answer"],
            "ttft_ms": ttft,
            "ttft_ms_runs": r["ttft_ms"],
            "speedup": full_ttft / ttft,
            "computed_tokens": r["prompt_rows"] - r["reused_rows"],
            "recomputed_share": r["recomputed_share"],
            "kl_to_full": r["kl"],
            "top1_agree": sum(r["top1"]) / len(r["top1"]),
            "answer_match_full": bool(r["match"]),
            "f1": r["score"] if asked.answers else None,
        }
    return {
        "model": eng.name, "dtype": eng.config.dtype, "device": str(eng.adapter.device),
        "threads": torch.get_num_threads(), "method": method, "ratio": ratio,
        "example": {"id": asked.id, "question": asked.question, "gold": list(asked.answers),
                    "documents": len(asked.documents), "prompt_tokens": record["prompt_tokens"],
                    "chunk_tokens": record["chunk_tokens"]},
        "encode_ms": encode_ms,
        "answer_positions": len(record["methods"][FULL_RECOMPUTE]["top1"]),
        "timed_runs": 1 + repeats,
        "methods": rows,
    }


def format_demo(report: dict, order: str) -> str:
    """The report as a side-by-side table with both answers below it."""
    ex = report["example"]
    full, ours = report["methods"].values()
    name = f"{report['method']} (r = {report['ratio']:g})"
    how = {"reversed": "in reverse order", "shuffled": "shuffled", "same": "in the same order"}[order]
    lines = [
        f"{report['model']} ({report['dtype']}, {report['device']}, {report['threads']} threads)",
        f"{ex['documents']} documents ({ex['chunk_tokens']:,} tokens) were cached once, each encoded alone "
        f"({report['encode_ms'] / 1000:.1f} s, a one-off).",
        f"Now a question arrives with them {how} ({ex['prompt_tokens']:,} prompt tokens):",
        f"  Q: {ex['question']}" + (f"   (gold: {' / '.join(ex['gold'])})" if ex["gold"] else ""),
        "",
    ]
    runs = report["timed_runs"]
    table = [
        ("", "full recompute", name),
        (f"time to first token{' (median of %d)' % runs if runs > 1 else ''}",
         f"{full['ttft_ms']:,.0f} ms", f"{ours['ttft_ms']:,.0f} ms"),
        ("speedup", "1.00x", f"{ours['speedup']:.2f}x"),
        ("prompt tokens computed", f"{full['computed_tokens']:,}", f"{ours['computed_tokens']:,}"),
        (f"KL to full recompute (mean, {report['answer_positions']} answer positions)", "0",
         f"{ours['kl_to_full']:.3f}"),
        ("top-1 agreement with full recompute", "1.000", f"{ours['top1_agree']:.3f}"),
        ("same answer as full recompute", "-", "yes" if ours["answer_match_full"] else "no"),
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        lines.append(f"{row[0]:<{widths[0]}}   {row[1]:>{widths[1]}}   {row[2]:>{widths[2]}}")
    lines += ["", f"full recompute: {full['answer'].strip()}", f"{name}: {ours['answer'].strip()}"]
    return "\n".join(lines)


def cmd_demo(args) -> int:
    first, asked = demo_example(args.example, args.docs, args.order, args.question)
    eng = engine(args)
    report = run_demo(eng, first, asked, args.max_new_tokens, args.repeats)
    report["order"] = args.order
    print(format_demo(report, args.order))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="one question over cached documents in a new order: full recompute and "
                                    "cachetune side by side (answers, TTFT, speedup, fidelity)")
    p.add_argument("--example", type=int, metavar="ROW",
                   help="a row of the bundled MuSiQue sample (10 passages, about 6K tokens) instead of the "
                        "built-in example (5 short documents)")
    p.add_argument("--docs", type=int, default=0, help="the example's first N documents only (0: all) [%(default)s]")
    p.add_argument("--order", choices=ORDERS, default="reversed",
                   help="the documents' order when the question comes [%(default)s]")
    p.add_argument("--question", help="ask this instead of the example's question (no gold answer then)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length at most [%(default)s]")
    p.add_argument("--repeats", type=int, default=1, help="extra timing passes of each method [%(default)s]")
    p.add_argument("--json", help="also write the report here")
    engine_args(p, own=("max_new_tokens",))
    p.set_defaults(func=cmd_demo)
