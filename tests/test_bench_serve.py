"""bench-serve's client: the arrival schedule, the SLO arithmetic, the loopback guard, the report
files, and a whole sweep against an in-process fake server (httpx.MockTransport: no network, no GPU)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx
import pytest
from tqdm import tqdm

from cachetune.eval.bench_serve import (
    Sample,
    ServeBenchConfig,
    check_loopback_url,
    document_order,
    format_table,
    gave_up,
    max_rate_under_slo,
    parse_sse_line,
    poisson_schedule,
    rescore,
    run_bench_serve,
    run_rate,
    send_request,
    speedups,
    summarize_rate,
    write_report,
)
from cachetune.engine.prompt import DEFAULT_SYSTEM
from cachetune.eval.datasets import QAExample


def test_poisson_schedule_is_reproducible_and_has_the_mean_rate():
    a, b = poisson_schedule(4.0, 20_001, seed=3), poisson_schedule(4.0, 20_001, seed=3)
    assert a == b and a != poisson_schedule(4.0, 20_001, seed=4)
    assert len(a) == 20_001 and a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.03)
    # Same seed, another rate: the same arrivals, time scaled.
    assert poisson_schedule(2.0, 50, seed=3) == pytest.approx([2 * t for t in poisson_schedule(4.0, 50, seed=3)])


def test_document_order_is_a_seeded_permutation():
    ids = [f"d{i}" for i in range(8)]
    shuffled = document_order(ids, "0/cachetune/1/3", shuffle=True)
    assert sorted(shuffled) == ids and shuffled == document_order(ids, "0/cachetune/1/3", shuffle=True)
    assert shuffled != ids  # 1 in 40320 by chance; this tag does move them
    assert document_order(ids, "any", shuffle=False) == ids


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.9.8.7", "https://localhost:1/x",
                                 "http://[::1]:8000"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback_url(url) == url
    assert ServeBenchConfig(url=url).url == url


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000",
                                 "http://127.0.0.1.example.com", "ftp://127.0.0.1", "http://[::2]", "127.0.0.1:8000"])
def test_other_hosts_are_refused(url):
    with pytest.raises(ValueError, match="this machine"):
        check_loopback_url(url)
    with pytest.raises(ValueError):
        ServeBenchConfig(url=url)


def _ok(ttft: float, tokens: int = 4, cached: int = 0, prompt: int = 100) -> Sample:
    return Sample("ok", ttft, ttft + 10, prompt, tokens, cached, ttft / 2)


def test_a_rate_is_sustained_when_its_percentile_meets_the_slo_and_nothing_was_lost():
    cfg = ServeBenchConfig(slo_ms=100, slo_percentile=90)
    fast = [_ok(10.0 * i, cached=50) for i in range(1, 11)]  # TTFTs 10..100 ms, p90 = 91
    row = summarize_rate(1.0, fast, wall_s=2.0, cfg=cfg)
    assert row["sustained"] and row["completed"] == row["sent"] == 10 and row["failed"] == row["rejected"] == 0
    assert row["ttft_ms_p50"] == pytest.approx(55) and row["ttft_ms_p90"] == pytest.approx(91)
    assert row["output_tokens_per_s"] == pytest.approx(40 / 2.0) and row["achieved_rate"] == pytest.approx(5.0)
    assert row["cached_share"] == pytest.approx(0.5) and row["server_ttft_ms_p50"] == pytest.approx(27.5)

    slow_tail = fast[:-2] + [_ok(500.0), _ok(600.0)]
    assert not summarize_rate(1.0, slow_tail, 2.0, cfg)["sustained"]

    rejected = fast[:-1] + [Sample("rejected", error="HTTP 429: busy")]
    row = summarize_rate(1.0, rejected, 2.0, cfg)
    assert not row["sustained"] and row["rejected"] == 1 and row["failed"] == 0 and row["completed"] == 9
    assert row["ttft_ms_p50"] == pytest.approx(50)  # the rejected request is no latency sample
    assert row["errors"] == ["HTTP 429: busy"]

    lost = fast[:-2] + [Sample("cancelled", error="late"), Sample("unsent")]
    row = summarize_rate(1.0, lost, 2.0, cfg)
    assert not row["sustained"] and row["sent"] == 9 and row["failed"] == 1


def test_a_rate_whose_completions_fall_behind_its_arrivals_is_not_sustained():
    cfg = ServeBenchConfig(slo_ms=100, min_rate_share=0.8)
    fast = [_ok(50.0) for _ in range(10)]
    assert summarize_rate(1.0, fast, 12.0, cfg)["sustained"]       # 10 done in 12 s at 1 req/s: kept up
    behind = summarize_rate(1.0, fast, 13.0, cfg)                   # 0.77 req/s: a queue was building
    assert behind["achieved_rate"] < 0.8 and not behind["sustained"]
    report = {"config": {"slo_ms": 100, "min_rate_share": 0.7}, "methods": {"full_recompute": {"rows": [behind]}}}
    assert rescore(report)["max_rate_under_slo"] == {"full_recompute": 1.0}  # judged again, by 0.7


def test_nothing_completed_gives_empty_percentiles_and_gives_up():
    cfg = ServeBenchConfig(slo_ms=100)
    row = summarize_rate(2.0, [Sample("rejected"), Sample("failed", error="boom")], 1.0, cfg)
    assert row["ttft_ms_p50"] is None and row["cached_share"] is None and not row["sustained"]
    assert gave_up(row, cfg)
    assert gave_up({"ttft_ms_p50": 301.0}, cfg) and not gave_up({"ttft_ms_p50": 299.0}, cfg)


def test_max_rate_under_slo_is_the_top_of_the_unbroken_run_of_sustained_rates():
    rows = [{"rate": r, "sustained": s} for r, s in [(2.0, False), (0.5, True), (1.0, True), (4.0, True)]]
    assert max_rate_under_slo(rows) == 1.0  # 4 req/s passing after 2 failed is noise, not capacity
    assert max_rate_under_slo([{"rate": 0.5, "sustained": False}]) == 0.0 and max_rate_under_slo([]) == 0.0


def test_speedup_over_full_recompute_needs_both_rates_positive():
    assert speedups({"full_recompute": 0.5, "cachetune": 2.0, "prefix": 0.0}) == \
        {"full_recompute": 1.0, "cachetune": 4.0, "prefix": None}
    assert speedups({"full_recompute": 0.0, "cachetune": 2.0}) == {"full_recompute": None, "cachetune": None}


def test_sse_lines():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None


def _report() -> dict:
    row = {"rate": 0.5, "sent": 4, "completed": 4, "failed": 0, "rejected": 0, "ttft_ms_p50": 120.0,
           "ttft_ms_p90": 180.0, "ttft_ms_p99": 199.0, "latency_ms_p50": 400.0, "output_tokens_per_s": 12.5,
           "achieved_rate": 0.48, "cached_share": 0.9, "sustained": True}
    slow = {**row, "rate": 1.0, "ttft_ms_p50": 9000.0, "ttft_ms_p99": 12000.0, "sustained": False}
    return {
        "config": {"requests_per_rate": 4, "max_tokens": 16, "slo_ms": 2000.0, "slo_percentile": 90.0},
        "model": "tiny", "examples": 2, "mean_document_tokens": 812.0,
        "methods": {
            "full_recompute": {"rows": [row, slow], "max_rate_under_slo": 0.5, "skipped_rates": [2.0],
                               "skipped_reason": None},
            "cachetune": {"rows": [row, {**row, "rate": 1.0}], "max_rate_under_slo": 1.0, "skipped_rates": [],
                          "skipped_reason": None},
            "c2kv": {"rows": [], "max_rate_under_slo": 0.0, "skipped_rates": [0.5, 1.0],
                     "skipped_reason": "warm-up request refused: HTTP 400: no extractor"},
        },
        "max_rate_under_slo": {"full_recompute": 0.5, "cachetune": 1.0, "c2kv": 0.0},
        "speedup_over_full_recompute": {"full_recompute": 1.0, "cachetune": 2.0, "c2kv": None},
    }


def test_write_report_writes_json_markdown_and_png(tmp_path):
    paths = write_report(_report(), tmp_path / "out")
    assert [p.name for p in paths] == ["bench_serve.json", "bench_serve.md", "ttft_vs_rate.png"]
    assert json.loads(paths[0].read_text()) == _report()
    assert paths[1].read_text() == format_table(_report()) + "\n"
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 5000


# --- against a fake server -------------------------------------------------------------------------

def test_runs_against_several_servers_combine_into_one_report_keyed_by_arm(tmp_path):
    from cachetune.eval.bench_serve import combine

    for arm, method, documents_as, p90s in (("vllm", "vllm", "text", (1500.0, 2500.0)),
                                           ("vllm_cachetune", "cachetune", "kv_transfer_params", (300.0, 400.0))):
        report = _report()
        rows = [{**row, "rate": rate, "ttft_ms_at_slo_percentile": p90, "achieved_rate": rate}
                for row, rate, p90 in zip(report["methods"]["cachetune"]["rows"], (0.5, 1.0), p90s)]
        report["methods"] = {method: {**report["methods"]["cachetune"], "rows": rows}}
        report["config"] = {**report["config"], "documents_as": documents_as}
        write_report(report, tmp_path / arm)
    combined = combine(tmp_path, ["vllm", "vllm_cachetune"])
    assert combined["max_rate_under_slo"] == {"vllm": 0.5, "vllm_cachetune": 1.0}  # SLO 2 s, the runs' own
    assert combine(tmp_path, ["vllm", "vllm_cachetune"], slo_ms=3000)["max_rate_under_slo"]["vllm"] == 1.0
    assert combined["arms"]["vllm_cachetune"] == {"documents_as": "kv_transfer_params", "method": "cachetune"}
    assert "| vllm_cachetune | 1 |" in format_table(combined)
    with pytest.raises(FileNotFoundError):
        combine(tmp_path, ["vllm", "cachetune"])


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _chunk(content: str | None = None, usage: dict | None = None, extra: dict | None = None) -> dict:
    chunk = {"object": "chat.completion.chunk",
             "choices": [] if content is None else [{"index": 0, "delta": {"content": content}}]}
    return {**chunk, **({"usage": usage} if usage else {}), **({"cachetune": extra} if extra else {})}


class FakeServer:
    """The documented API: documents by content hash, streamed answers, one overloaded method
    (every other request 429), one refused (400), one slow (fixed delay before answering)."""

    def __init__(self, delays: dict[str, float]):
        self.delays, self.texts, self.chats, self.auth = delays, {}, [], set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.auth.add(request.headers.get("authorization"))
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny-model"}]})
        body = json.loads(request.content)
        if request.url.path == "/v1/documents":
            ids = [hashlib.md5(t.encode()).hexdigest() for t in body["texts"]]
            self.texts.update(zip(ids, body["texts"]))
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": i, "object": "document", "tokens": len(t.split())} for i, t in zip(ids, body["texts"])]})
        self.chats.append(body)
        method = body["method"]
        if method == "c2kv":
            return httpx.Response(400, json={"error": {"message": "c2kv needs an extractor"}})
        if method == "prefix" and len([b for b in self.chats if b["method"] == "prefix"]) % 2 == 0:
            return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"message": "busy"}})
        assert all(d in self.texts for d in body["documents"]) and body["stream"]
        await asyncio.sleep(self.delays.get(method, 0.0))
        usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                 "prompt_tokens_details": {"cached_tokens": 30}}
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, _chunk("Paris"), _chunk("."),
            _chunk(usage=usage, extra={"ttft_ms": 7.0, "recomputed_tokens": 6, "method": method})))


def _examples(n: int = 3) -> list[QAExample]:
    return [QAExample(f"ex-{i}", [f"doc {i}.{j} text" for j in range(4)], f"question {i}?", ["a"]) for i in range(n)]


def test_a_sweep_against_a_fake_server():
    server = FakeServer({"full_recompute": 0.4})
    cfg = ServeBenchConfig(methods=("full_recompute", "cachetune", "prefix", "c2kv"), rates=(40.0, 80.0),
                           requests_per_rate=6, slo_ms=100, prompts=2, docs_per_prompt=3, api_key="sk-test",
                           ratio=0.2, max_seconds_per_rate=10)
    report = run_bench_serve(cfg, progress=False, examples=_examples(), transport=httpx.MockTransport(server))
    assert server.auth == {"Bearer sk-test"}
    assert len(server.texts) == 6  # 2 examples x 3 documents, registered once
    warm, timed = server.chats[0], server.chats[2]  # one warm-up per example, then the first timed request
    assert warm["max_tokens"] == 1 and timed["max_tokens"] == 16
    assert timed["model"] == "tiny-model" and len(timed["documents"]) == 3
    # The ratio goes to methods that take one; the server refuses it for the others.
    assert {c.get("ratio") for c in server.chats if c["method"] == "cachetune"} == {0.2}
    assert not any("ratio" in c for c in server.chats if c["method"] in ("full_recompute", "prefix"))
    assert timed["messages"] == [{"role": "system", "content": DEFAULT_SYSTEM},
                                 {"role": "user", "content": "Question: question 0?"}]

    methods = report["methods"]
    fast = methods["cachetune"]
    assert [r["rate"] for r in fast["rows"]] == [40.0, 80.0] and fast["max_rate_under_slo"] == 80.0
    assert all(r["completed"] == 6 and r["sustained"] for r in fast["rows"])
    assert fast["rows"][0]["cached_share"] == pytest.approx(0.75)
    assert fast["rows"][0]["server_ttft_ms_p50"] == 7.0
    assert fast["rows"][0]["output_tokens_per_s"] > 0

    slow = methods["full_recompute"]  # p50 ~400 ms > 3 x 100 ms: the climb stops after the first rate
    assert len(slow["rows"]) == 1 and slow["skipped_rates"] == [80.0] and slow["max_rate_under_slo"] == 0.0
    assert slow["rows"][0]["ttft_ms_p50"] >= 400

    busy = methods["prefix"]  # half rejected: fast answers, not sustained, yet worth the next rate
    assert [r["rejected"] for r in busy["rows"]] == [3, 3] and busy["max_rate_under_slo"] == 0.0
    assert all(r["completed"] == 3 and r["failed"] == 0 for r in busy["rows"])

    refused = methods["c2kv"]
    assert refused["rows"] == [] and "c2kv needs an extractor" in refused["skipped_reason"]
    assert report["speedup_over_full_recompute"] == {m: None for m in cfg.methods}  # full recompute: 0
    assert report["max_rate_under_slo"]["cachetune"] == 80.0
    text = json.dumps(report)
    assert "sk-test" not in text and json.loads(text)["config"]["api_key"] == "<set>"


async def _timed(transport: httpx.MockTransport) -> Sample:
    sample = Sample()
    async with httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=transport) as client:
        await send_request(client, {"method": "x"}, sample)
    return sample


class Clock:
    """A stand-in for time.perf_counter that moves only when the fake server says time has passed."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _streamed(clock: Clock, *parts: tuple[float, dict]) -> httpx.MockTransport:
    """A server that sends each chunk `delay` seconds (of `clock`) after the one before."""
    async def body():
        for delay, chunk in parts:
            clock.now += delay
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body()))


def test_ttft_is_the_first_chunk_with_content_not_the_role_chunk(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    sample = asyncio.run(_timed(_streamed(clock, (0.0, role), (0.15, _chunk("Hi")),
                                          (0.15, _chunk(usage={"completion_tokens": 1})))))
    assert sample.status == "ok" and sample.completion_tokens == 1
    assert sample.ttft_ms == pytest.approx(150) and sample.latency_ms == pytest.approx(300)
    empty = asyncio.run(_timed(_streamed(clock, (0.1, role), (0.2, _chunk(usage={"completion_tokens": 0})))))
    assert empty.status == "ok"  # an empty answer: TTFT is the first chunk at all
    assert empty.ttft_ms == pytest.approx(100) and empty.latency_ms == pytest.approx(300)


def test_a_stream_error_and_a_dropped_connection_are_failures():
    failed = asyncio.run(_timed(_streamed(Clock(), (0.0, {"error": {"message": "out of memory"}}))))
    assert failed.status == "failed" and "out of memory" in failed.error

    def drop(request):
        raise httpx.ConnectError("refused")
    dropped = asyncio.run(_timed(httpx.MockTransport(drop)))
    assert dropped.status == "failed" and "ConnectError" in dropped.error


def test_requests_still_out_after_the_time_limit_are_cancelled_and_later_ones_never_sent():
    async def hang(request):
        await asyncio.sleep(30)

    async def go():
        cfg = ServeBenchConfig(max_seconds_per_rate=0.3)
        async with httpx.AsyncClient(base_url=cfg.url, transport=httpx.MockTransport(hang)) as client:
            return await run_rate(client, [{}] * 3, [0.0, 0.1, 5.0], cfg, tqdm(disable=True))

    samples, wall = asyncio.run(go())
    assert [s.status for s in samples] == ["cancelled", "cancelled", "unsent"]
    assert wall >= 0.3  # the limit, and not the third arrival (5 s) nor the hanging answers (30 s)
    assert wall < 5.0
