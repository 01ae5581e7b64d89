"""`cachetune bench-serve`: time to first token against request rate over HTTP (the paper's Figure 4).

A pure HTTP client of an already running cachetune server on this machine (loopback only). Setup,
untimed: every example's documents are registered once (`POST /v1/documents`), keeping their ids.
Then, per method and per rate (ascending), `requests_per_rate` streaming chat completions are sent
on a Poisson schedule (exponential gaps, seeded: the same arrival times for every method), cycling
through the examples; each names its example's documents by id, in a fresh seeded random order when
`shuffle_documents` (the non-prefix case), with the RAG system prompt and "Question: ..." as the
messages. One untimed warm-up request per example precedes each method's first rate; a method the
server refuses (HTTP 400) is skipped with its reason. After `max_seconds_per_rate` nothing more is sent and requests in flight are cancelled.

Measured per request, on the client: TTFT = send -> first SSE chunk with non-empty content (the first
chunk at all when the answer is empty), latency = send -> end of stream; from the final chunk the
completion and cached prompt tokens (`usage`) and the server's own TTFT (`cachetune.ttft_ms`).
HTTP 429 / 503 answers are counted as rejected, other errors and cancelled requests as failed;
neither gives a latency sample. A rate is sustained when every request was sent and completed, the
`slo_percentile`-th percentile TTFT is within `slo_ms`, and completions kept pace with arrivals
(completed / wall time >= `min_rate_share` x the rate: a short run above the server's capacity can
otherwise meet the SLO before its queue has grown); `max_rate_under_slo` is the highest rate
with every rate up to it sustained (0 if none). A method stops climbing once a rate's median TTFT
exceeds `give_up_factor` x SLO, or nothing completed; the rates left are reported as skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from tqdm import tqdm

from cachetune.engine.prompt import DEFAULT_SYSTEM, QUESTION_LABEL
from cachetune.eval.datasets import QAExample, load_dataset
from cachetune.eval.report import pyplot, save_figure, write_json
from cachetune.methods import method_settings

METHODS = ("full_recompute", "prefix", "cacheblend", "cachetune", "c2kv")
BASELINE = "full_recompute"
REJECTED_STATUS = (429, 503)  # overload: the server asks the client to come back later
DOCUMENTS_AS = ("ids", "kv_transfer_params", "text")


def check_loopback_url(url: str) -> str:
    """`url` itself when it is http(s) to localhost, 127.0.0.0/8 or ::1; else ValueError."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it could resolve anywhere
        loopback = False
    if parts.scheme not in ("http", "https") or not loopback:
        raise ValueError(f"{url!r}: bench-serve only drives a server on this machine: "
                         "http(s) to localhost, 127.0.0.0/8 or ::1")
    return url


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    methods: tuple[str, ...] = METHODS
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)  # requests/s, run in ascending order
    requests_per_rate: int = 16
    max_seconds_per_rate: float = 120.0  # then stop sending and cancel what is in flight
    slo_ms: float = 2000.0  # TTFT service-level objective
    slo_percentile: float = 90.0
    give_up_factor: float = 3.0  # skip higher rates once the median TTFT exceeds this x SLO
    min_rate_share: float = 0.8  # sustained only if completions kept up: achieved >= this x offered rate
    max_tokens: int = 16
    data: str = "2wikimqa"  # a dataset name or file for load_dataset
    docs_per_prompt: int = 0  # 0: all of an example's documents
    prompts: int = 8  # examples to cycle through
    seed: int = 0
    api_key: str | None = None  # sent as a bearer token; never written to the report
    ratio: float | None = None  # None: the server's default
    shuffle_documents: bool = True
    model: str | None = None  # None: the first of GET /v1/models
    request_timeout_s: float = 600.0
    # How a request brings its documents: "ids" (cachetune serve: `documents` by id, the server builds
    # the prompt), "kv_transfer_params" (vLLM with the cachetune connector: the texts in the message,
    # the ids in kv_transfer_params), "text" (any OpenAI server, vLLM alone: the texts in the message).
    documents_as: str = "ids"

    def __post_init__(self) -> None:
        check_loopback_url(self.url)
        if not self.methods or not self.rates or min(self.rates) <= 0:
            raise ValueError("need at least one method and one rate, rates > 0")
        if self.requests_per_rate < 1 or self.prompts < 1 or self.max_tokens < 1 or self.docs_per_prompt < 0:
            raise ValueError("requests_per_rate, prompts and max_tokens must be >= 1, docs_per_prompt >= 0")
        if not 0 <= self.min_rate_share <= 1:
            raise ValueError("min_rate_share must be in [0, 1]")
        if self.max_seconds_per_rate <= 0 or self.slo_ms <= 0 or not 0 < self.slo_percentile <= 100:
            raise ValueError("max_seconds_per_rate and slo_ms must be > 0, slo_percentile in (0, 100]")
        if self.documents_as not in DOCUMENTS_AS:
            raise ValueError(f"documents_as must be one of {', '.join(DOCUMENTS_AS)}")


@dataclass
class Sample:
    """One request. status: unsent -> sent -> ok | rejected | refused (400) | failed | cancelled."""
    status: str = "unsent"
    ttft_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    server_ttft_ms: float | None = None
    error: str | None = None


def wait_until_healthy(url: str, seconds: float) -> None:
    """Poll GET /health until it answers 200 (a server still loading its model); RuntimeError after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {seconds:g} s")
        time.sleep(0.5)


def poisson_schedule(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s from the start) of n requests: the first at 0, then exponential gaps of mean 1/rate.
    The same seed gives the same times, and the schedules of different rates are one another scaled."""
    gaps = np.random.default_rng(seed).exponential(1.0, size=max(0, n - 1)) / rate
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def document_order(ids: list[str], tag: str, shuffle: bool) -> list[str]:
    """The documents of one request: `ids` shuffled by a generator seeded with `tag` (reproducible)."""
    out = list(ids)
    if shuffle:
        random.Random(tag).shuffle(out)
    return out


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (linear interpolation, as numpy's), None for no values."""
    return float(np.percentile(values, p)) if values else None


def summarize_rate(rate: float, samples: list[Sample], wall_s: float, cfg: ServeBenchConfig) -> dict:
    """One (method, rate) row; `sustained` per the module docstring."""
    ok = [s for s in samples if s.status == "ok"]
    ttft = [s.ttft_ms for s in ok]
    rejected = sum(s.status == "rejected" for s in samples)
    sent = sum(s.status != "unsent" for s in samples)
    at_slo = percentile(ttft, cfg.slo_percentile)
    row = {
        "rate": rate, "sent": sent, "completed": len(ok), "rejected": rejected,
        "failed": sent - len(ok) - rejected,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90), "ttft_ms_p99": percentile(ttft, 99),
        "ttft_ms_at_slo_percentile": at_slo,
        "latency_ms_p50": percentile([s.latency_ms for s in ok], 50),
        "server_ttft_ms_p50": percentile([s.server_ttft_ms for s in ok if s.server_ttft_ms is not None], 50),
        "output_tokens_per_s": sum(s.completion_tokens for s in ok) / wall_s if wall_s > 0 else 0.0,
        "achieved_rate": len(ok) / wall_s if wall_s > 0 else 0.0,
        "cached_share": float(np.mean([s.cached_tokens / s.prompt_tokens for s in ok if s.prompt_tokens]))
        if any(s.prompt_tokens for s in ok) else None,
        "wall_s": wall_s,
        "all_completed": len(ok) == len(samples),
        "errors": sorted({s.error for s in samples if s.error})[:5],
    }
    row["sustained"] = is_sustained(row, cfg.slo_ms, cfg.min_rate_share)
    return row


def is_sustained(row: dict, slo_ms: float, min_rate_share: float) -> bool:
    """Every request completed, the SLO percentile's TTFT within `slo_ms`, and completions kept pace
    with arrivals (a short run above capacity can meet the SLO before its queue grows)."""
    at_slo = row["ttft_ms_at_slo_percentile"]
    return (row.get("all_completed", row["completed"] == row["sent"]) and at_slo is not None and at_slo <= slo_ms
            and row["achieved_rate"] >= min_rate_share * row["rate"])


def rescore(report: dict) -> dict:
    """`sustained`, max rates and speedups of `report` from its rows and its config's slo_ms and
    min_rate_share (after a run, or to judge a saved report by other criteria)."""
    cfg = report["config"]
    for method in report["methods"].values():
        for row in method["rows"]:
            row["sustained"] = is_sustained(row, cfg["slo_ms"], cfg.get("min_rate_share", 0.0))
        method["max_rate_under_slo"] = max_rate_under_slo(method["rows"])
    report["max_rate_under_slo"] = {m: r["max_rate_under_slo"] for m, r in report["methods"].items()}
    report["speedup_over_full_recompute"] = speedups(report["max_rate_under_slo"])
    return report


def gave_up(row: dict, cfg: ServeBenchConfig) -> bool:
    """Whether the rate failed so badly that higher rates are not worth their time."""
    return row["ttft_ms_p50"] is None or row["ttft_ms_p50"] > cfg.give_up_factor * cfg.slo_ms


def max_rate_under_slo(rows: list[dict]) -> float:
    """The highest rate with it and every lower measured rate sustained (rows ascending); 0 if none."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not row["sustained"]:
            break
        best = row["rate"]
    return best


def parse_sse_line(line: str) -> dict | str | None:
    """A `data: {...}` line's JSON object, "[DONE]" for the end marker, None for anything else."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    return payload if payload == "[DONE]" else json.loads(payload)


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {response.status_code}: {message or response.text[:200]}"


async def send_request(client: httpx.AsyncClient, body: dict, sample: Sample) -> None:
    """Stream one chat completion, filling `sample` in place (so a cancelled request keeps its state).
    Never raises for the server's sake: transport errors and unparsable streams are failures."""
    sample.status = "sent"
    start = time.perf_counter()
    first_chunk = first_content = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                sample.error = _error_text(response)
                sample.status = ("rejected" if response.status_code in REJECTED_STATUS
                                 else "refused" if response.status_code == 400 else "failed")
                return
            async for line in response.aiter_lines():
                event = parse_sse_line(line)
                if event == "[DONE]":
                    break
                if event is None:
                    continue
                now = time.perf_counter()
                first_chunk = first_chunk or now
                if "error" in event:
                    sample.status, sample.error = "failed", f"stream error: {event['error']}"
                    return
                choices = event.get("choices") or []
                if first_content is None and choices and (choices[0].get("delta") or {}).get("content"):
                    first_content = now
                _absorb_usage(event, sample)
    except (httpx.HTTPError, ValueError) as e:
        sample.status, sample.error = "failed", f"{type(e).__name__}: {e}"
        return
    end = time.perf_counter()
    if first_chunk is None:
        sample.status, sample.error = "failed", "stream ended without a chunk"
        return
    sample.ttft_ms = ((first_content or first_chunk) - start) * 1000
    sample.latency_ms = (end - start) * 1000
    sample.status = "ok"


def _absorb_usage(event: dict, sample: Sample) -> None:
    """Token counts from `usage` and the server's TTFT from `cachetune`, when the chunk carries them."""
    usage = event.get("usage") or {}
    sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
    sample.completion_tokens = usage.get("completion_tokens", sample.completion_tokens)
    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", sample.cached_tokens)
    sample.server_ttft_ms = (event.get("cachetune") or {}).get("ttft_ms", sample.server_ttft_ms)


async def run_rate(client: httpx.AsyncClient, bodies: list[dict], schedule: list[float],
                   cfg: ServeBenchConfig, bar: tqdm) -> tuple[list[Sample], float]:
    """Send bodies[i] at schedule[i] s; after max_seconds_per_rate cancel the rest. (samples, wall s)."""
    samples = [Sample() for _ in bodies]
    start = time.perf_counter()

    async def fire(at: float, body: dict, sample: Sample) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        try:
            await send_request(client, body, sample)
        finally:
            bar.update(1)

    tasks = [asyncio.create_task(fire(at, b, s)) for at, b, s in zip(schedule, bodies, samples)]
    _, pending = await asyncio.wait(tasks, timeout=cfg.max_seconds_per_rate)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for s in samples:
        if s.status == "sent":  # in flight when the time ran out
            s.status, s.error = "cancelled", f"not done after {cfg.max_seconds_per_rate:g} s"
    return samples, time.perf_counter() - start


@dataclass
class Prepared:
    """What setup learned: the served model name, and per example its question and document ids."""
    model: str
    questions: list[str]
    documents: list[list[str]]  # ids per example, dataset order (positions as ids where nothing registers)
    document_tokens: list[int]  # per example, as the server counted them
    texts: list[list[str]] = dataclasses.field(default_factory=list)  # per example, dataset order


async def prepare(client: httpx.AsyncClient, examples: list[QAExample], cfg: ServeBenchConfig) -> Prepared:
    """Check the server is up, find the model name, register every example's documents (untimed)."""
    health = await client.get("/health")
    if health.status_code != 200:
        raise RuntimeError(f"{cfg.url}/health answered {health.status_code}: server not ready")
    model = cfg.model
    if model is None:
        models = await client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
    prepared = Prepared(model, [ex.question for ex in examples], [], [])
    for ex in examples:
        texts = ex.documents[:cfg.docs_per_prompt] if cfg.docs_per_prompt else ex.documents
        prepared.texts.append(list(texts))
        if cfg.documents_as == "text":  # nothing to register: the server sees only text
            prepared.documents.append([str(k) for k in range(len(texts))])
            prepared.document_tokens.append(0)
            continue
        response = await client.post("/v1/documents", json={"texts": texts})
        if response.status_code != 200:
            raise RuntimeError(f"registering the documents of {ex.id}: {_error_text(response)}")
        data = response.json()["data"]
        if len(data) != len(texts):
            raise RuntimeError(f"{ex.id}: sent {len(texts)} documents, got {len(data)} ids back")
        prepared.documents.append([d["id"] for d in data])
        prepared.document_tokens.append(sum(d.get("tokens", 0) for d in data))
    return prepared


def request_bodies(cfg: ServeBenchConfig, prep: Prepared, method: str, tag: str, n: int) -> list[dict]:
    """n streaming chat-completion bodies cycling through the examples, each with the documents by id in
    an order seeded by (seed, method, tag, index): reproducible, and unlikely to repeat an earlier request's
    order (which a prefix cache would serve whole)."""
    if cfg.documents_as != "ids":
        return [_text_body(cfg, prep, method, tag, i) for i in range(n)]
    takes_ratio = "ratio" in {f.name for f in dataclasses.fields(method_settings(method))}
    extra = {"ratio": cfg.ratio} if cfg.ratio is not None and takes_ratio else {}  # the server refuses it elsewhere
    return [{"model": prep.model, "messages": [
                {"role": "system", "content": DEFAULT_SYSTEM},
                {"role": "user", "content": QUESTION_LABEL + prep.questions[i % len(prep.questions)]}],
             "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
             "documents": document_order(prep.documents[i % len(prep.documents)], f"{cfg.seed}/{method}/{tag}/{i}",
                                         cfg.shuffle_documents),
             "method": method, **extra}
            for i in range(n)]


def _text_body(cfg: ServeBenchConfig, prep: Prepared, method: str, tag: str, i: int) -> dict:
    """A body whose documents are text in the user message, each on lines of its own, in the same seeded
    order as `request_bodies`; with documents_as "kv_transfer_params" their ids name them too."""
    example = i % len(prep.documents)
    order = document_order(prep.documents[example], f"{cfg.seed}/{method}/{tag}/{i}", cfg.shuffle_documents)
    text_of = dict(zip(prep.documents[example], prep.texts[example]))
    content = "\n\n".join(text_of[key] for key in order) + "\n\n" + QUESTION_LABEL + prep.questions[example]
    body = {"model": prep.model, "messages": [{"role": "system", "content": DEFAULT_SYSTEM},
                                              {"role": "user", "content": content}],
            "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.documents_as == "kv_transfer_params":
        params = {"documents": order, "method": method}
        if cfg.ratio is not None:
            params["ratio"] = cfg.ratio
        body["kv_transfer_params"] = params
    return body


async def bench_method(client: httpx.AsyncClient, prep: Prepared, method: str, cfg: ServeBenchConfig,
                       progress: bool) -> dict:
    """Warm up, then climb the rates; {"rows", "max_rate_under_slo", "skipped_rates", "skipped_reason"}."""
    out = {"rows": [], "max_rate_under_slo": 0.0, "skipped_rates": [], "skipped_reason": None}
    # One untimed request per example: what a method does once per chunk (an extractor's compressed
    # rows, a ranking it stores) is done here, not inside the first rate's timings.
    for body in request_bodies(cfg, prep, method, "warmup", len(prep.questions)):
        for _ in range(5):  # an overloaded server (429/503) is given a few seconds
            warm = Sample()
            await send_request(client, {**body, "max_tokens": 1}, warm)
            if warm.status != "rejected":
                break
            await asyncio.sleep(1.0)
        if warm.status != "ok":
            out["skipped_reason"] = f"warm-up request {warm.status}: {warm.error}"
            out["skipped_rates"] = sorted(cfg.rates)
            return out
    rates = sorted(cfg.rates)
    with tqdm(total=len(rates) * cfg.requests_per_rate, desc=method, disable=not progress) as bar:
        for k, rate in enumerate(rates):
            schedule = poisson_schedule(rate, cfg.requests_per_rate, cfg.seed)
            bodies = request_bodies(cfg, prep, method, f"{rate:g}", cfg.requests_per_rate)
            samples, wall = await run_rate(client, bodies, schedule, cfg, bar)
            row = summarize_rate(rate, samples, wall, cfg)
            out["rows"].append(row)
            if gave_up(row, cfg):
                out["skipped_rates"] = rates[k + 1:]
                break
    out["max_rate_under_slo"] = max_rate_under_slo(out["rows"])
    return out


def machine() -> dict:
    """The client's machine (the server's too: the URL is loopback)."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count()}


def speedups(max_rates: dict[str, float]) -> dict[str, float | None]:
    """max rate under SLO of each method over full recompute's; None unless both are > 0."""
    base = max_rates.get(BASELINE, 0.0)
    return {m: r / base if base > 0 and r > 0 else None for m, r in max_rates.items()}


async def _bench(cfg: ServeBenchConfig, examples: list[QAExample], progress: bool,
                 transport: httpx.AsyncBaseTransport | None) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # NOTE: trust_env=False so no proxy from the environment sits between us and the loopback server;
    # no connection limit so requests never queue inside the client, which would inflate TTFT.
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=cfg.request_timeout_s,
                                 trust_env=False, transport=transport,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        prep = await prepare(client, examples, cfg)
        methods = {m: await bench_method(client, prep, m, cfg, progress) for m in cfg.methods}
    config = {**asdict(cfg), "api_key": "<set>" if cfg.api_key else None,
              "methods": list(cfg.methods), "rates": list(cfg.rates)}
    return rescore({
        "config": config, "machine": machine(), "model": prep.model, "examples": len(examples),
        "mean_document_tokens": float(np.mean(prep.document_tokens)) if prep.document_tokens else 0.0,
        "methods": methods,
    })


def run_bench_serve(config: ServeBenchConfig, progress: bool = True, *, examples: list[QAExample] | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run the whole sweep against the server at config.url; a JSON-ready report. `examples` replaces
    loading config.data; `transport` replaces the network (tests)."""
    if examples is None:
        examples = load_dataset(config.data, config.prompts)
    return asyncio.run(_bench(config, examples[:config.prompts], progress, transport))


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(report: dict) -> str:
    """Markdown: one row per (method, rate), then max rate under the SLO per method."""
    cfg = report["config"]
    lines = [f"{report['model']}: {report['examples']} examples (~{report['mean_document_tokens']:.0f} document "
             f"tokens), {cfg['requests_per_rate']} requests per rate, {cfg['max_tokens']} output tokens, "
             f"SLO p{cfg['slo_percentile']:g} TTFT <= {cfg['slo_ms']:g} ms", "",
             "| method | rate req/s | sent | done | failed | rejected | TTFT p50 ms | p90 | p99 | latency p50 ms | "
             "out tok/s | achieved req/s | cached share | under SLO |", "|" + "---|" * 14]
    for method, result in report["methods"].items():
        for r in result["rows"]:
            lines.append(f"| {method} | {r['rate']:g} | {r['sent']} | {r['completed']} | {r['failed']} | "
                         f"{r['rejected']} | {_fmt(r['ttft_ms_p50'])} | {_fmt(r['ttft_ms_p90'])} | "
                         f"{_fmt(r['ttft_ms_p99'])} | {_fmt(r['latency_ms_p50'])} | {_fmt(r['output_tokens_per_s'], 1)} | "
                         f"{_fmt(r['achieved_rate'], 2)} | {_fmt(r['cached_share'], 2)} | "
                         f"{'yes' if r['sustained'] else 'no'} |")
    lines += ["", "| method | max rate under SLO (req/s) | vs full_recompute | not run |", "|---|---|---|---|"]
    for method, result in report["methods"].items():
        speedup = report["speedup_over_full_recompute"].get(method)
        skipped = result["skipped_reason"] or ", ".join(f"{r:g}" for r in result["skipped_rates"])
        lines.append(f"| {method} | {result['max_rate_under_slo']:g} | "
                     f"{'-' if speedup is None else f'{speedup:.2f}x'} | {skipped} |")
    return "\n".join(lines)


def plot_ttft_vs_rate(report: dict, path: str | Path) -> Path:
    """TTFT p50 (solid) and p99 (dashed) against request rate, one colour per method, the SLO dotted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, result) in enumerate(report["methods"].items()):
        rows = [r for r in result["rows"] if r["ttft_ms_p50"] is not None]
        if not rows:
            continue
        xs, color = [r["rate"] for r in rows], plt.cm.tab10(i % 10)
        ax.plot(xs, [r["ttft_ms_p50"] for r in rows], "o-", color=color, label=f"{method} p50")
        ax.plot(xs, [r["ttft_ms_p99"] for r in rows], "s--", color=color, label=f"{method} p99")
    ax.axhline(report["config"]["slo_ms"], color="gray", linestyle=":", label="SLO")
    ax.set_yscale("log")
    ax.set(xlabel="request rate (req/s, Poisson arrivals)", ylabel="TTFT (ms, client side)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path, f"{Path(report['model']).name}: TTFT against request rate")  # vLLM names a path


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """bench_serve.json, bench_serve.md and ttft_vs_rate.png in out_dir (created)."""
    out = Path(out_dir)
    write_json(report, out / "bench_serve.json")
    (out / "bench_serve.md").write_text(format_table(report) + "\n", encoding="utf-8")
    return [out / "bench_serve.json", out / "bench_serve.md", plot_ttft_vs_rate(report, out / "ttft_vs_rate.png")]


def combine(out_dir: str | Path, arms: list[str], slo_ms: float | None = None) -> dict:
    """One report of several runs, each in out_dir/<arm>/bench_serve.json with one method, keyed by arm
    (the same workload against different servers: vLLM alone, vLLM with the connector, cachetune),
    judged by `slo_ms` (None: the first run's)."""
    reports = {arm: json.loads((Path(out_dir) / arm / "bench_serve.json").read_text()) for arm in arms}
    for arm, report in reports.items():
        if len(report["methods"]) != 1:
            raise ValueError(f"{arm}: a combined arm has one method, not {sorted(report['methods'])}")
    first = next(iter(reports.values()))
    config = {**first["config"], "methods": list(arms)}
    if slo_ms is not None:
        config["slo_ms"] = slo_ms
    combined = {**first, "config": config,
                "mean_document_tokens": max(r["mean_document_tokens"] for r in reports.values()),
                "methods": {arm: next(iter(r["methods"].values())) for arm, r in reports.items()},
                "arms": {arm: {"documents_as": r["config"].get("documents_as", "ids"),
                               "method": next(iter(r["methods"]))} for arm, r in reports.items()}}
    return rescore(combined)
