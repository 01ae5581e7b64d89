"""Redis killed under load, on the real model: every request must still answer.

Starts its own redis-server and `cachetune serve --tiers [FRONT,]redis://...` (by default Redis is the
only tier, so every chunk read goes to it; --front cpu:4GiB puts a CPU tier before it), registers the documents, then sends streamed cachetune requests on a Poisson
schedule for --seconds; Redis is SIGKILLed at --kill-at and started again (empty) at --restart-at.
Each request is reported by the phase it was sent in (before, outage, after): sent, answered, failed,
TTFT p50 / p90 and the cached share; then the server's tier errors, hits and chunks encoded.

    python scripts/redis_fault.py --out results/smollm2/serve/redis_fault.json
    python scripts/redis_fault.py --front cpu:4GiB --out results/smollm2/serve/redis_fault_cpu_front.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cachetune.eval.bench_serve import (Sample, ServeBenchConfig, percentile, poisson_schedule, prepare,
                                        request_bodies, send_request, wait_until_healthy)
from cachetune.eval.datasets import load_dataset


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(port: int, folder: str) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                return proc
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("cachetune:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def load(cfg: ServeBenchConfig, examples, seconds: float, rate: float, kill_at: float, restart_at: float,
               kill, restart) -> tuple[list[Sample], list[float]]:
    async with httpx.AsyncClient(base_url=cfg.url, timeout=600, trust_env=False) as client:
        prep = await prepare(client, examples, cfg)
        n = int(seconds * rate * 2) + 10
        schedule = [t for t in poisson_schedule(rate, n, cfg.seed) if t < seconds]
        bodies = request_bodies(cfg, prep, "cachetune", "fault", len(schedule))
        samples = [Sample() for _ in schedule]
        start = time.perf_counter()

        async def fire(at, body, sample):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            await send_request(client, body, sample)

        async def faults():
            await asyncio.sleep(kill_at)
            kill()
            await asyncio.sleep(restart_at - kill_at)
            restart()

        await asyncio.gather(faults(), *(fire(at, b, s) for at, b, s in zip(schedule, bodies, samples)))
    return samples, schedule


def phase_rows(samples: list[Sample], schedule: list[float], kill_at: float, restart_at: float) -> list[dict]:
    rows = []
    for name, lo, hi in (("before", 0, kill_at), ("outage", kill_at, restart_at), ("after", restart_at, 1e9)):
        mine = [s for s, t in zip(samples, schedule) if lo <= t < hi]
        ok = [s for s in mine if s.status == "ok"]
        ttft = [s.ttft_ms for s in ok]
        rows.append({"phase": name, "sent": len(mine), "answered": len(ok), "failed": len(mine) - len(ok),
                     "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
                     "cached_share": sum(s.cached_tokens for s in ok) / max(1, sum(s.prompt_tokens for s in ok)),
                     "errors": sorted({s.error for s in mine if s.error})[:3]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--rate", type=float, default=0.4, help="requests/s (Poisson) [0.4]")
    p.add_argument("--kill-at", type=float, default=30.0)
    p.add_argument("--restart-at", type=float, default=60.0)
    p.add_argument("--data", default="2wikimqa")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--front", default="", help="tiers before Redis, e.g. cpu:4GiB (default: none, Redis alone)")
    p.add_argument("--out", default="results/smollm2/serve/redis_fault.json")
    args = p.parse_args()

    folder = tempfile.mkdtemp()
    redis_port, port = free_port(), free_port()
    redis = [start_redis(redis_port, folder)]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "cachetune.cli", "serve", "--port", str(port), "--threads", "2",
                               "--tiers", ",".join(t for t in (args.front, f"redis://127.0.0.1:{redis_port}") if t),
                               "--log-level", "warning"])
    try:
        wait_until_healthy(url, 300)
        cfg = ServeBenchConfig(url=url, max_tokens=16, data=args.data, docs_per_prompt=args.docs,
                               prompts=args.prompts)
        examples = load_dataset(args.data, args.prompts)

        def kill():
            redis[0].kill()
            redis[0].wait()

        def restart():
            redis[0] = start_redis(redis_port, folder)

        samples, schedule = asyncio.run(load(cfg, examples, args.seconds, args.rate, args.kill_at, args.restart_at,
                                             kill, restart))
        rows = phase_rows(samples, schedule, args.kill_at, args.restart_at)
        m = metrics(url)
        report = {"config": vars(args), "phases": rows,
                  "server": {k: v for k, v in m.items() if "tier" in k or "chunks_encoded" in k or "requests_total" in k}}
    finally:
        server.terminate()
        server.wait(30)
        redis[0].kill()
    table = ["| phase | sent | answered | failed | TTFT p50 ms | TTFT p90 ms | cached share |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['phase']} | {r['sent']} | {r['answered']} | {r['failed']} | {r['ttft_ms_p50'] or 0:.0f} | "
                     f"{r['ttft_ms_p90'] or 0:.0f} | {r['cached_share']:.2f} |")
    print("\n".join(table))
    print(json.dumps(report["server"], indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
