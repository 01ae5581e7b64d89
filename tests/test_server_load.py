"""The server under load and faults: many concurrent clients, Redis killed mid-load, two server
processes sharing one Redis, and bench-serve driving a real server."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from conftest import build_model, word_tokenizer, words
from cachetune.config import ServerConfig
from test_server import Served

DOCS = [words(50 + 10 * i, 100 + i) for i in range(4)]
METHODS = ("cachetune", "full_recompute", "cacheblend", "prefix", "full_reuse", "epic")


def mixed_requests(n: int, ids: list[str], seed: int = 0) -> list[tuple[str, dict]]:
    """n (endpoint, body) pairs: chat or completions, streamed or not, every method, documents by id
    (any subset, any order) or inline, greedy, 1-16 new tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs: list = rng.sample(ids, rng.randint(0, len(ids)))
        if rng.random() < 0.2:
            docs.append(words(30, 500 + i % 5))  # inline, cached on first sight
        body = {"max_tokens": rng.randint(1, 16), "temperature": 0, "stream": rng.random() < 0.5,
                "documents": docs, "method": rng.choice(METHODS)}
        if rng.random() < 0.5:
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words(6, i)}]}))
        else:
            out.append(("/v1/completions", {**body, "prompt": words(6, i)}))
    return out


def send(http: httpx.Client, path: str, body: dict) -> tuple[int, str, str | None]:
    """(status, text, finish_reason) of one request, streamed or not."""
    if not body["stream"]:
        r = http.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, r.text, None
        choice = r.json()["choices"][0]
        return 200, choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]
    text, reason = "", None
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(), None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500, event["error"]["message"], None
            for choice in event["choices"]:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                reason = choice["finish_reason"] or reason
    return 200, text, reason


def run_clients(url: str, requests: list[tuple[str, dict]], clients: int, results: list | None = None) -> list:
    """Every request sent once, by `clients` threads at the same time; results in request order (in
    `results` as they come, when given)."""
    results = results if results is not None else [None] * len(requests)
    order = iter(range(len(requests)))
    lock = threading.Lock()

    def client():
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                results[i] = send(http, *requests[i])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_200_mixed_requests_from_8_clients_each_equal_to_the_request_served_alone():
    with Served(ServerConfig(max_queue=256)) as s:
        ids = s.register(*DOCS)
        requests = mixed_requests(200, ids)
        alone = [send(s.http, path, body) for path, body in requests]
        assert all(status == 200 for status, _, _ in alone), [r for r in alone if r[0] != 200][:3]
        together = run_clients(s.url, requests, clients=8)
        lost = [i for i, r in enumerate(together) if r is None or r[0] != 200]
        assert not lost, [together[i] for i in lost[:3]]
        wrong = [i for i in range(len(requests)) if together[i] != alone[i]]
        assert not wrong, [(requests[i], alone[i], together[i]) for i in wrong[:3]]
        assert s.metric("cachetune:requests_total", '{endpoint="chat",finish_reason="length"}') + \
            s.metric("cachetune:requests_total", '{endpoint="completions",finish_reason="length"}') + \
            s.metric("cachetune:requests_total", '{endpoint="chat",finish_reason="stop"}') + \
            s.metric("cachetune:requests_total", '{endpoint="completions",finish_reason="stop"}') == 400
        assert s.engine.kv_usage().used_rows == 0


def test_redis_killed_under_load_every_request_answers_and_the_tier_recovers(redis_server):
    with Served(ServerConfig(max_queue=256), tiers=redis_server.url) as s:  # every chunk read from Redis
        ids = s.register(*DOCS)
        requests = [(p, {**b, "method": "cachetune"}) for p, b in mixed_requests(120, ids, seed=1)]
        reference = [send(s.http, p, b) for p, b in requests[:20]]
        results: list = [None] * len(requests)
        load = threading.Thread(target=run_clients, args=(s.url, requests, 8, results))
        load.start()
        while sum(r is not None for r in results) < 30:
            time.sleep(0.005)
        encoded = s.engine.chunks_encoded
        redis_server.kill()  # mid-load, as a crash would
        after = len(requests) - sum(r is not None for r in results)
        load.join(120)
        assert after >= 60  # most of the load ran with Redis gone
        distinct = {d if isinstance(d, str) else d["text"] for _, b in requests for d in b["documents"]}
        assert s.engine.chunks_encoded - encoded <= len(distinct)  # once per chunk, not once per request
        failed = [r for r in results if r is None or r[0] != 200]
        assert not failed, failed[:3]
        assert results[:20] == reference  # recomputed chunks give the same answers
        assert s.metric("cachetune:tier_errors_total", '{tier="redis"}') >= 1

        redis_server.start()  # empty (no persistence): the engine stores what it encodes again
        time.sleep(1.2)  # past the tier's back-off
        again = run_clients(s.url, requests[:16], clients=4)
        assert again == [send(s.http, p, b) for p, b in requests[:16]]
        assert all(r[0] == 200 for r in again)
        assert redis_server.client().dbsize() > 0
        hits = s.metric("cachetune:tier_hits_total", '{tier="redis"}')
        assert send(s.http, *requests[0])[0] == 200
        assert s.metric("cachetune:tier_hits_total", '{tier="redis"}') > hits  # read from Redis again


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(model_dir: Path, tiers: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cachetune.cli", "serve", "--model", str(model_dir),
                             "--port", str(port), "--tiers", tiers, "--threads", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def _metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_two_server_processes_share_one_redis_a_document_registered_on_one_is_served_by_the_other(
        tmp_path, redis_url):
    model_dir = tmp_path / "tiny-llama"
    build_model("llama").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    tiers = f"cpu:64MiB,{redis_url}"
    servers = [_start_server(model_dir, tiers) for _ in range(2)]
    try:
        for proc, url in servers:
            _wait_healthy(proc, url)
        (_, a), (_, b) = servers
        docs = [words(70, int(time.time() * 1000) % 100000 + i) for i in range(3)]  # new to this Redis
        ids = [d["id"] for d in httpx.post(f"{a}/v1/documents", json={"texts": docs}).json()["data"]]
        assert httpx.get(f"{b}/v1/documents/{ids[1]}").json()["tokens"] == 70
        body = {"messages": [{"role": "user", "content": words(6, 1)}], "max_tokens": 8, "temperature": 0,
                "documents": ids[::-1]}
        on_b = httpx.post(f"{b}/v1/chat/completions", json=body, timeout=60).json()
        on_a = httpx.post(f"{a}/v1/chat/completions", json=body, timeout=60).json()
        assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
        assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _metric(b, "cachetune:chunks_encoded_total") == 0  # b encoded nothing: it read a's
        assert _metric(b, "cachetune:tier_hits_total", '{tier="redis"}') >= 3
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_bench_serve_drives_a_real_server_and_reports_every_method():
    from cachetune.eval.bench_serve import ServeBenchConfig, run_bench_serve, wait_until_healthy
    from cachetune.eval.datasets import QAExample

    examples = [QAExample(f"tiny-{i}", [words(60, 10 * i + j) for j in range(3)], words(6, i), ["w1"])
                for i in range(3)]
    with Served() as s:
        wait_until_healthy(s.url, 5)
        config = ServeBenchConfig(url=s.url, methods=("full_recompute", "cachetune"), rates=(4.0, 8.0),
                                  requests_per_rate=6, max_seconds_per_rate=30, slo_ms=5000, max_tokens=4)
        report = run_bench_serve(config, progress=False, examples=examples)
    for method in ("full_recompute", "cachetune"):
        rows = report["methods"][method]["rows"]
        assert [r["rate"] for r in rows] == [4.0, 8.0]
        assert all(r["completed"] == r["sent"] == 6 and r["failed"] == 0 for r in rows)
        assert all(r["ttft_ms_p50"] > 0 and r["output_tokens_per_s"] > 0 for r in rows)
    assert report["methods"]["full_recompute"]["rows"][0]["cached_share"] == 0
    assert report["methods"]["cachetune"]["rows"][0]["cached_share"] > 0.5
    assert report["max_rate_under_slo"]["cachetune"] == 8.0


def test_waiting_for_a_server_that_never_answers_fails_once_its_time_is_up(monkeypatch):
    import pytest

    from cachetune.eval.bench_serve import wait_until_healthy

    class Clock:  # time passes only in sleep(): the test takes no real waiting
        now = 0.0

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.now += seconds

    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock.monotonic)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    with pytest.raises(RuntimeError, match="did not answer 200 within 3 s"):
        wait_until_healthy(f"http://127.0.0.1:{_free_port()}", 3.0)
    assert 3.0 <= clock.now <= 4.0  # it kept asking for its 3 s, and stopped then
