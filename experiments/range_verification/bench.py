"""What does verifying every range read from a shared tier cost in TTFT?

Chunks of MuSiQue prompts are stored on a real Redis server (one started here) and in real files,
then every prompt is prefilled (cachetune's selection, the full loading pipeline, as
`cachetune bench-pipeline` times TTFT) with two readers of the same stored chunks, interleaved
within every repeat and alternating which goes first:

    verified  the tier's own reader: ranges widened to block boundaries, every block hashed
              (xxh3_64) and compared with the sums held since the chunk's verified first read
    plain     a benchmark-only copy of the reader before range verification: the exact ranges,
              nothing checked (not a knob of the store: it lives in this script only)

The price is median(verified) / median(plain) per prompt, then the median over prompts. Beside it:
the hashing alone per request (the same checks timed on bytes already in memory), the extra bytes
the widening reads, and a throughput table of candidate hashes on this machine.

    .venv/bin/python experiments/range_verification/bench.py     # ~3-4 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from cachetune.engine.engine import Engine
from cachetune.eval.bench_batch import example_prompt
from cachetune.eval.bench_pipeline import moved_layout
from cachetune.eval.datasets import bundled_sample_path, load_dataset
from cachetune.runtime.prefill import selective_prefill
from cachetune.runtime.loading import Pipeline
from cachetune.store import blob
from cachetune.store.blob import ModelShape
from cachetune.store.disk import DiskReader, DiskStore, byte_view, read_exact
from cachetune.store.redis import RedisReader, RedisStore, TierUnavailableError
from cachetune.tuning.profile import top_selections

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------------
# Benchmark-only readers: the code the store had before range verification (exact ranges, unchecked).

class PlainDiskReader(DiskReader):
    def plan(self, spans):
        def read(layer: int, out: torch.Tensor) -> None:
            view, at = byte_view(out), 0
            for chunk, lo, hi in spans:
                offset, length = chunk.layout.span(layer, lo, hi)
                read_exact(chunk.fileno(), offset, view[at: at + length])
                at += length
            self.bytes_read += at

        return read


class PlainRedisReader(RedisReader):
    def plan(self, spans):
        def read(layer: int, out: torch.Tensor) -> None:
            ranges = [(chunk.key, *chunk.layout.span(layer, lo, hi)) for chunk, lo, hi in spans]

            def fetch(r):
                pipe = r.pipeline(transaction=False)
                for key, offset, length in ranges:
                    pipe.getrange(key, offset, offset + length - 1)
                return pipe.execute()

            values = self.store.call(fetch, mid_request=True)
            view, at = byte_view(out), 0
            for (key, _, length), value in zip(ranges, values):
                if len(value) != length:
                    raise TierUnavailableError(f"redis value {key} is gone or short")
                view[at: at + length] = value
                at += length
            self.bytes_read += at

        return read


# ---------------------------------------------------------------------------------------------------

def machine() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "xxhash": xxhash.VERSION,
            "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        lscpu = ""
    flags = ""
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            info["cpu"] = value.strip()
        if key.strip() == "Flags":
            flags = value.split()
    info["avx512_bf16"] = "avx512_bf16" in flags
    info["amx"] = any(f.startswith("amx") for f in flags)
    info.setdefault("cpu", platform.processor() or "unknown")
    return info


def hash_throughput(block_bytes: int, total: int = 64 << 20) -> dict[str, float]:
    """GB/s of each candidate hash over `total` random bytes in blocks of `block_bytes` (best of 3)."""
    data = memoryview(os.urandom(total))
    candidates = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake2b-64": lambda b: hashlib.blake2b(b, digest_size=8).digest(),
        "crc32 (zlib)": zlib.crc32,
        "xxh3_64": lambda b: xxhash.xxh3_64_intdigest(b, 12345),
    }
    out = {}
    for name, fn in candidates.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for at in range(0, total, block_bytes):
                fn(data[at: at + block_bytes])
            best = min(best, time.perf_counter() - start)
        out[name] = total / best / 1e9
    return out


class OwnRedis:
    """A redis-server of this benchmark on a free loopback port (no persistence)."""

    def __init__(self, tmp: Path):
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt install redis-server), or pass --redis-url")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{port}"
        import redis

        client = redis.Redis(port=port)
        for _ in range(250):
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def hashing_alone_ms(chunks, spans_of, tier_store) -> tuple[float, int]:
    """(ms, bytes) of the block checks of one request on bytes already in memory: for every layer
    and chunk, the covering blocks of its span, checked as the verified reader checks them."""
    blobs = {}
    for chunk in chunks:
        if isinstance(tier_store, DiskStore):
            blobs[chunk.chunk_id] = tier_store.path(chunk.chunk_id).read_bytes()
        else:
            blobs[chunk.chunk_id] = tier_store.client.get(chunk.key)
    work = []
    for chunk, lo, hi in spans_of:
        lay = chunk.layout
        a, b = lay.covering(lo, hi)
        for layer in range(lay.layers):
            offset, length = lay.span(layer, a, b)
            work.append((lay, layer, a, b, memoryview(blobs[chunk.chunk_id])[offset: offset + length]))
    return checks_ms(work), sum(len(w[-1]) for w in work)


def checks_ms(work) -> float:
    """Best of 3 timings (ms) of the block checks of `work`: (layout, layer, lo, hi, bytes) ranges."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for lay, layer, a, b, view in work:
            lay.check(layer, a, b, [view])
        best = min(best, time.perf_counter() - start)
    return best * 1000


RATIOS = [i / 20 for i in range(1, 11)]  # recompute shares 0.05 .. 0.5


def block_sweep(layouts, ratio: float, fingerprint: str, sizes: list[int]) -> list[dict]:
    """Per block size, on the prompts' chunks packed in memory (no tier): the hashing of one request's
    checks (ms, median over prompts), the bytes the widening adds, the block sums held per chunk."""
    keep = blob.BLOCK_BYTES
    rows = []
    try:
        for size in sizes:
            blob.BLOCK_BYTES = size
            ms, widening, sums = [], [], []
            for layout in layouts:
                selections = top_selections(layout, ratio)
                work, plain = [], 0
                for chunk, lo, hi in spans_of(layout, selections):
                    data = blob.pack(chunk.encoded(), fingerprint)
                    lay = blob.verify(data, fingerprint, chunk.chunk_id, None).layout
                    sums.append(len(lay.sums) * 8)
                    row_bytes = lay.row_bytes
                    a, b = lay.covering(lo, hi)
                    plain += (hi - lo) * lay.row_bytes * lay.layers
                    for layer in range(lay.layers):
                        offset, length = lay.span(layer, a, b)
                        work.append((lay, layer, a, b, memoryview(data)[offset: offset + length]))
                ms.append(checks_ms(work))
                widening.append(100 * (sum(len(w[-1]) for w in work) / plain - 1))
            extra = read = 0  # the widening over many recompute shares, so no one share's luck decides
            for layout in layouts:
                for r in RATIOS:
                    for chunk, lo, hi in spans_of(layout, top_selections(layout, r)):
                        br = blob.block_rows_for(row_bytes)
                        extra += lo % br + min((-hi) % br, int(chunk.ranking.numel()) - hi)
                        read += hi - lo
            rows.append({"block_bytes": size, "hashing_ms": statistics.median(ms),
                         "widening_percent": statistics.median(widening),
                         "widening_percent_over_ratios": 100 * extra / read,
                         "sums_bytes_per_chunk": statistics.median(sums)})
            print(f"  blocks of {size:>6} B: hashing one request {rows[-1]['hashing_ms']:.1f} ms, "
                  f"widening +{rows[-1]['widening_percent']:.1f}% bytes "
                  f"(+{rows[-1]['widening_percent_over_ratios']:.1f}% over r = 0.05..0.5), "
                  f"{rows[-1]['sums_bytes_per_chunk']:.0f} B of sums per chunk", flush=True)
    finally:
        blob.BLOCK_BYTES = keep
    return rows


def load_alone_ms(layout, selections, reader) -> float:
    """ms to read every layer of one request's reuse complement with `reader`, no compute."""
    spans = [(c, lo, hi) for c, lo, hi in spans_of(layout, selections)]
    row = spans[0][0].layout
    out = torch.empty(sum(hi - lo for _, lo, hi in spans), 2, row.kv_heads, row.head_dim, dtype=row.dtype)
    read = reader.plan(spans)
    start = time.perf_counter()
    for layer in range(row.layers):
        read(layer, out)
    return (time.perf_counter() - start) * 1000


def spans_of(layout, selections):
    """(chunk, lo, hi) rank range each chunk's reuse complement is read as (LayerLoader's choice)."""
    out = []
    for (_, seg), chosen in zip(layout.chunk_segments, selections):
        keep = torch.ones(seg.chunk.num_tokens, dtype=torch.bool)
        keep[chosen] = False
        ranks = seg.chunk.rank_of[keep.nonzero().flatten()]
        if ranks.numel():
            out.append((seg.chunk, int(ranks.min()), int(ranks.max()) + 1))
    return out


@torch.no_grad()
def run(args) -> dict:
    info = machine()
    block_sizes = [int(b) for b in args.block_bytes.split(",")] if args.block_bytes else [blob.BLOCK_BYTES]
    print(f"machine: {info['cpu']}, {info['cores']} cores, avx512_bf16={info['avx512_bf16']}, amx={info['amx']}, "
          f"load average {info['load_average_at_start'][0]:.2f}", flush=True)
    throughput = hash_throughput(block_sizes[0])
    print("hash throughput (GB/s, blocks of %d bytes): %s" % (
        block_sizes[0], ", ".join(f"{k} {v:.2f}" for k, v in throughput.items())), flush=True)

    try:
        examples = load_dataset(args.data, args.limit)
        data = args.data
    except FileNotFoundError:
        examples = load_dataset(str(bundled_sample_path()), args.limit)
        data = str(bundled_sample_path())
    engine = Engine.from_pretrained(self_check=False, threads=args.threads)
    info["torch_threads"] = torch.get_num_threads()
    shape = ModelShape(*engine.adapter.kv_shape)
    layouts = [example_prompt(engine, ex, args.docs) for ex in examples]
    print(f"{len(layouts)} prompts from {data}, {engine.adapter.dtype}, tokens "
          f"{[l.total for l in layouts]}", flush=True)

    print("block size (in memory, no tier):", flush=True)
    sweep = block_sweep(layouts, args.ratio, engine.fingerprint,
                        [int(b) for b in args.sweep.split(",")] if args.sweep else [])
    tiers = args.tiers.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="range-verification-") as tmp:
        server = OwnRedis(Path(tmp)) if "redis" in tiers and not args.redis_url else None
        try:
            for block_bytes in block_sizes:
                blob.BLOCK_BYTES = block_bytes  # what pack writes from now on (stored chunks below are new)
                for tier in tiers:
                    if tier == "redis":
                        store = RedisStore(args.redis_url or server.url, engine.fingerprint, shape=shape,
                                           prefix=f"rangebench{block_bytes}")
                        plain = PlainRedisReader(store)
                    else:
                        store = DiskStore(Path(tmp) / f"disk{block_bytes}", engine.fingerprint, shape=shape)
                        plain = PlainDiskReader(store)
                    results.append(bench_tier(engine, layouts, store, plain, tier, block_bytes, args))
        finally:
            if server is not None:
                server.stop()
    info["load_average_at_end"] = os.getloadavg()
    return {"question": "TTFT price of verifying every range read from the redis and disk tiers",
            "date": datetime.date.today().isoformat(), "machine": info, "data": data,
            "prompts": len(layouts), "ratio": args.ratio, "repeats": args.repeats,
            "hash_throughput_GBps": {"block_bytes": block_sizes[0], **throughput}, "block_sweep": sweep,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]), "tiers": results}


def bench_tier(engine, layouts, store, plain, tier, block_bytes, args) -> dict:
    verified = store.reader
    per_prompt = []
    for p, layout in enumerate(layouts):
        moved = moved_layout(layout, store)
        chunks = [seg.chunk for _, seg in moved.chunk_segments]
        chosen = top_selections(moved, args.ratio)
        runs: dict[str, list[float]] = {"verified": [], "plain": []}
        loads: dict[str, list[float]] = {"verified": [], "plain": []}
        nbytes, logits = {}, {}
        for rep in range(args.repeats + 1):  # the first pass warms up and is not counted
            for arm in (("verified", "plain") if rep % 2 == 0 else ("plain", "verified")):
                reader = verified if arm == "verified" else plain
                for chunk in chunks:
                    chunk.reader = reader
                read_before = reader.bytes_read
                start = time.perf_counter()
                result = selective_prefill(engine.adapter, moved, chosen, moved.total, Pipeline())
                ms = (time.perf_counter() - start) * 1000
                if rep == 0:
                    logits[arm] = result.logits
                    if len(logits) == 2 and not torch.equal(logits["verified"], logits["plain"]):
                        raise RuntimeError("the two readers gave different prefills")
                nbytes[arm] = reader.bytes_read - read_before
                load_ms = load_alone_ms(moved, chosen, reader)
                if rep:
                    runs[arm].append(ms)
                    loads[arm].append(load_ms)
        for chunk in chunks:
            chunk.reader = verified
        hash_ms, hashed = hashing_alone_ms(chunks, spans_of(moved, chosen), store)
        v, q = statistics.median(runs["verified"]), statistics.median(runs["plain"])
        per_prompt.append({"tokens": moved.total, "chunks": len(chunks), "verified_ms": v, "plain_ms": q,
                           "ratio": v / q, "paired_ratios": [a / b for a, b in zip(runs["verified"], runs["plain"])],
                           "runs_ms": runs, "bytes_plain": nbytes["plain"], "bytes_verified": nbytes["verified"],
                           "hashing_alone_ms": hash_ms, "bytes_hashed": hashed,
                           "load_alone_verified_ms": statistics.median(loads["verified"]),
                           "load_alone_plain_ms": statistics.median(loads["plain"])})
        print(f"  {tier} blocks {block_bytes} B, prompt {p}: {moved.total} tokens, {nbytes['plain'] / 1e6:.0f} MB read, "
              f"TTFT verified {v:.0f} ms, plain {q:.0f} ms, ratio {v / q:.3f}; hashing alone {hash_ms:.1f} ms; "
              f"load alone verified {per_prompt[-1]['load_alone_verified_ms']:.0f} ms, "
              f"plain {per_prompt[-1]['load_alone_plain_ms']:.0f} ms", flush=True)
    if getattr(store, "errors", 0):
        raise RuntimeError(f"{tier}: {store.errors} tier errors during the benchmark")
    ratio = statistics.median(r["ratio"] for r in per_prompt)
    return {"tier": tier, "block_bytes": block_bytes,
            "block_rows": moved.chunk_segments[0][1].chunk.layout.block_rows,
            "ratio_median_over_prompts": ratio, "price_percent": (ratio - 1) * 100,
            "verified_ms_median": statistics.median(r["verified_ms"] for r in per_prompt),
            "plain_ms_median": statistics.median(r["plain_ms"] for r in per_prompt),
            "paired_ratio_median": statistics.median(x for r in per_prompt for x in r["paired_ratios"]),
            "hashing_alone_ms_median": statistics.median(r["hashing_alone_ms"] for r in per_prompt),
            "load_alone_verified_ms_median": statistics.median(r["load_alone_verified_ms"] for r in per_prompt),
            "load_alone_plain_ms_median": statistics.median(r["load_alone_plain_ms"] for r in per_prompt),
            "MB_read_plain_median": statistics.median(r["bytes_plain"] for r in per_prompt) / 1e6,
            "widening_percent_median": statistics.median(100 * (r["bytes_verified"] / r["bytes_plain"] - 1)
                                                         for r in per_prompt),
            "per_prompt": per_prompt}


def table(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Range verification price ({report['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, avx512_bf16={m['avx512_bf16']}, amx={m['amx']}; load average "
             f"{m['load_average_at_start'][0]:.2f} at start, {m['load_average_at_end'][0]:.2f} at end; "
             f"{m['torch_threads']} torch threads.",
             f"{report['prompts']} prompts ({report['data']}), r = {report['ratio']}, {report['repeats']} timed repeats "
             "per arm, interleaved.", f"Command: `{report['command']}`", "",
             "| tier | block | TTFT verified ms | TTFT plain ms | verified / plain | paired runs | "
             "load alone verified / plain ms | hashing alone ms | MB read | widening |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in report["tiers"]:
        lines.append(f"| {t['tier']} | {t['block_bytes'] // 1024} KiB ({t['block_rows']} rows) | "
                     f"{t['verified_ms_median']:.0f} | {t['plain_ms_median']:.0f} | "
                     f"**{t['ratio_median_over_prompts']:.3f}** | {t['paired_ratio_median']:.3f} | "
                     f"{t['load_alone_verified_ms_median']:.0f} / {t['load_alone_plain_ms_median']:.0f} | "
                     f"{t['hashing_alone_ms_median']:.1f} | "
                     f"{t['MB_read_plain_median']:.0f} | +{t['widening_percent_median']:.1f}% |")
    if report["block_sweep"]:
        lines += ["", "Block size, in memory (one request's checks; the tokens' K/V read by cachetune's selection):", "",
                  "| block | hashing ms per request | widening at r | widening over r = 0.05..0.5 | "
                  "block sums per chunk |", "|---|---|---|---|---|"]
        for r in report["block_sweep"]:
            lines.append(f"| {r['block_bytes'] // 1024} KiB | {r['hashing_ms']:.1f} | +{r['widening_percent']:.1f}% | "
                         f"+{r['widening_percent_over_ratios']:.1f}% | {r['sums_bytes_per_chunk']:.0f} B |")
    h = report["hash_throughput_GBps"]
    lines += ["", f"Hash throughput on this machine, blocks of {h['block_bytes']} bytes (GB/s): " +
              ", ".join(f"{k} {v:.2f}" for k, v in h.items() if k != "block_bytes")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="musique", help="dataset name or file (falls back to the bundled sample)")
    parser.add_argument("--limit", type=int, default=3, help="prompts [3]")
    parser.add_argument("--docs", type=int, default=3, help="documents per prompt (0: all) [3]")
    parser.add_argument("--ratio", type=float, default=0.15, help="share of every chunk recomputed [0.15]")
    parser.add_argument("--repeats", type=int, default=4, help="timed prefills per arm and prompt [4]")
    parser.add_argument("--sweep", default="4096,8192,16384,32768,65536,131072,262144",
                        help="block sizes whose hashing and widening are measured in memory ('' : none)")
    parser.add_argument("--tiers", default="redis,disk")
    parser.add_argument("--block-bytes", default="", help="comma-separated block sizes to compare "
                        f"(default: the store's, {blob.BLOCK_BYTES})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, as the engine's; 1 is steadier on a busy machine)")
    parser.add_argument("--redis-url", default="", help="an existing server (default: start one)")
    parser.add_argument("--out", default=str(HERE / "results" / "range_verification"),
                        help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = table(report)
    out.with_suffix(".md").write_text(text + "\n")
    print()
    print(text)
    print()
    for t in report["tiers"]:
        print(f"PRICE {t['tier']} (blocks of {t['block_bytes']} B): TTFT verified / plain = "
              f"{t['ratio_median_over_prompts']:.3f} ({t['price_percent']:+.1f}%)")


if __name__ == "__main__":
    main()
