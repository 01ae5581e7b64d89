"""`cachetune vllm-serve`: vLLM's own OpenAI server with the connector, the documents route and the blend
salt, driven by the official `openai` client. One real server serves every test here (start-up takes
about a minute on 2 cores).

Skipped where vLLM is not installed; CI installs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm")
import openai  # noqa: E402  (a test dependency: never skipped for lack of it)

from cachetune.vllm.serve import MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.real_model

TEXTS = [
    "The Eiffel Tower is in Paris, the capital of France. It was built in 1889 for the World's Fair and is 330 "
    "metres tall.",
    "Mount Everest is the highest mountain on Earth, on the border of Nepal and China. Its summit is 8,849 "
    "metres above sea level.",
    "The Amazon river flows through Brazil and is the largest river by discharge volume. It rises in the Andes "
    "mountains of Peru.",
]
QUESTION = "Question: How tall is the Eiffel Tower?"
START_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`cachetune vllm-serve` in a process group of its own, on a free port."""

    def __init__(self, tiers: str, log: Path, model: Path | None = None, tensor_parallel: int = 1):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cli = Path(sys.executable).with_name("cachetune")
        bind = "0|1" if tensor_parallel == 2 else "0-1"  # one core per rank
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        chosen = ["--model", str(model)] if model is not None else []
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(cli), "vllm-serve", *chosen, "--port", str(self.port), "--tiers", tiers, "--ratio", "0.15", "--",
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                 "--kv-cache-memory-bytes", str(1 << 30), "--tensor-parallel-size", str(tensor_parallel)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self) -> str:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"vllm-serve exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"vllm-serve did not start in {START_SECONDS} s:\n{self.log.read_text()[-4000:]}")
            time.sleep(2)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = Server(f"disk:{tmp_path_factory.mktemp('tier')}:1GiB", tmp_path_factory.mktemp("log") / "serve.log")
    try:
        yield started.wait()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def documents(server):
    reply = httpx.post(f"{server}/v1/documents", json={"texts": TEXTS}, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"]


def _client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _model(client) -> str:
    return client.models.list().data[0].id


def test_documents_are_registered_once_by_content(server, documents):
    assert [d["tokens"] > 10 for d in documents] == [True] * len(TEXTS)
    assert len({d["id"] for d in documents}) == len(TEXTS)
    again = httpx.post(f"{server}/v1/documents", json={"texts": TEXTS[::-1]}, timeout=300).json()["data"]
    assert [d["id"] for d in again] == [d["id"] for d in documents[::-1]]


def test_bad_documents_get_a_clear_400(server):
    for body in ({"texts": []}, {"texts": [1]}, {"texts": "a text"}, {"text": ["a"]}):
        reply = httpx.post(f"{server}/v1/documents", json=body, timeout=30)
        assert reply.status_code == 400 and "texts" in reply.json()["error"]["message"]
    reply = httpx.post(f"{server}/v1/documents", content=b"{not json", timeout=30)
    assert reply.status_code == 400
    reply = httpx.post(f"{server}/v1/documents", content=b" " * (MAX_BODY_BYTES + 1), timeout=60)
    assert reply.status_code == 413


def test_chat_with_documents_in_a_new_order_reuses_them_and_streams_the_same_text(server, documents):
    client = _client(server)
    ids = [d["id"] for d in documents][::-1]
    messages = [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": "\n\n".join(TEXTS[::-1]) + "\n\n" + QUESTION}]
    extra = {"kv_transfer_params": {"documents": ids}}
    plain = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=12, temperature=0,
                                           extra_body=extra)
    assert plain.usage.prompt_tokens_details.cached_tokens > sum(d["tokens"] for d in documents) // 2
    reported = plain.model_extra["kv_transfer_params"]["cachetune"]
    assert reported["documents"] == ids and reported["method"] == "cachetune"
    streamed = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=12, temperature=0,
                                              extra_body=extra, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == plain.choices[0].message.content and text


def test_completions_with_documents_reuse_them_and_a_plain_request_is_left_to_vllm(server, documents):
    client = _client(server)
    prompt = "\n" + "\n\n".join(TEXTS[1:]) + "\n\n" + QUESTION + "\nAnswer:"
    ids = [d["id"] for d in documents[1:]]
    blended = client.completions.create(model=_model(client), prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"kv_transfer_params": {"documents": ids}})
    assert blended.model_extra["kv_transfer_params"]["cachetune"]["documents"] == ids
    streamed = client.completions.create(model=_model(client), prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"kv_transfer_params": {"documents": ids}}, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == blended.choices[0].text
    plain = client.completions.create(model=_model(client), prompt=prompt, max_tokens=8, temperature=0)
    assert not (plain.model_extra.get("kv_transfer_params") or {}).get("cachetune")


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def test_metrics_report_blends_registrations_and_tier_reads_beside_vllms(server, documents):
    client = _client(server)
    messages = [{"role": "user", "content": "\n".join(TEXTS) + "\n\n" + QUESTION}]
    client.chat.completions.create(model=_model(client), messages=messages, max_tokens=2, temperature=0,
                                   extra_body={"kv_transfer_params": {"documents": [d["id"] for d in documents]}})
    text = httpx.get(f"{server}/metrics", timeout=30).text
    assert _metric(text, "vllm:prompt_tokens_total") > 0  # vLLM's own, in the same exposition
    assert _metric(text, "vllm:cachetune_registered_total") >= len(TEXTS)
    assert _metric(text, "vllm:cachetune_saved_documents_total") >= len(TEXTS)
    assert _metric(text, "vllm:cachetune_blended_requests_total") >= 1
    assert _metric(text, "vllm:cachetune_reused_tokens_total") > 0
    assert _metric(text, "vllm:cachetune_computed_tokens_total") > 0
    assert _metric(text, "vllm:cachetune_tier_hits_total", tier="disk") >= 1
    assert _metric(text, "vllm:cachetune_recomputed_by_vllm_total") == 0


def test_two_replicas_on_one_redis_compute_a_document_once_and_redis_dying_costs_only_recomputes(
        redis_server, tmp_path):
    replicas = [Server(redis_server.url, tmp_path / f"replica{i}.log") for i in range(2)]
    try:
        first, second = (replica.wait() for replica in replicas)
        ids = [d["id"] for d in httpx.post(f"{first}/v1/documents", json={"texts": TEXTS}, timeout=300).json()["data"]]
        again = httpx.post(f"{second}/v1/documents", json={"texts": TEXTS}, timeout=300).json()["data"]
        assert [d["id"] for d in again] == ids
        client = _client(second)
        messages = [{"role": "user", "content": "\n\n".join(TEXTS[::-1]) + "\n\n" + QUESTION}]
        extra = {"kv_transfer_params": {"documents": ids[::-1]}}
        served = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=8, temperature=0,
                                                extra_body=extra)
        assert served.model_extra["kv_transfer_params"]["cachetune"]["documents"] == ids[::-1]
        assert served.choices[0].message.content
        metrics = httpx.get(f"{second}/metrics", timeout=30).text
        assert _metric(metrics, "vllm:cachetune_registered_total") == 0  # no encode on this replica
        assert _metric(metrics, "vllm:cachetune_saved_documents_total") == 0
        assert _metric(metrics, "vllm:cachetune_blended_requests_total") >= 1
        assert _metric(metrics, "vllm:cachetune_tier_hits_total", tier="redis") >= len(TEXTS)

        redis_server.kill()
        started = time.monotonic()
        answers = [client.chat.completions.create(model=_model(client), messages=messages, max_tokens=8,
                                                  temperature=0, extra_body=extra, timeout=120)
                   for _ in range(3)]
        assert all(a.choices[0].message.content for a in answers)
        assert time.monotonic() - started < 180
        metrics = httpx.get(f"{second}/metrics", timeout=30).text
        assert _metric(metrics, "vllm:cachetune_recomputed_by_vllm_total") >= 1
    finally:
        for replica in replicas:
            replica.stop()


def test_bench_serve_drives_vllm_with_documents_as_text_or_named_in_kv_transfer_params(server):
    from cachetune.eval.bench_serve import ServeBenchConfig, run_bench_serve
    from cachetune.eval.datasets import QAExample

    examples = [QAExample("tiny-0", TEXTS, "How tall is the Eiffel Tower?", ["330 metres"])]
    reports = {}
    for mode, method in (("kv_transfer_params", "cachetune"), ("text", "vllm")):
        config = ServeBenchConfig(url=server, methods=(method,), rates=(2.0,), requests_per_rate=3,
                                  max_seconds_per_rate=60, slo_ms=30000, max_tokens=4, documents_as=mode)
        reports[mode] = run_bench_serve(config, progress=False, examples=examples)["methods"][method]["rows"][0]
    for row in reports.values():
        assert row["completed"] == row["sent"] == 3 and row["failed"] == 0 and row["ttft_ms_p50"] > 0
    assert reports["kv_transfer_params"]["cached_share"] > 0.5  # the documents were reused


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="tensor parallel 2 on CUDA needs two GPUs")
def test_tensor_parallel_two_serves_documents_named_by_the_openai_client(tiny_vllm_model, tmp_path):
    served = Server(f"disk:{tmp_path / 'tier'}:256MiB", tmp_path / "tp2.log", model=tiny_vllm_model,
                    tensor_parallel=2)
    try:
        url = served.wait()
        documents = httpx.post(f"{url}/v1/documents", json={"texts": TEXTS}, timeout=300).json()["data"]
        client = _client(url)
        ids = [d["id"] for d in documents][::-1]
        messages = [{"role": "user", "content": "\n\n".join(TEXTS[::-1]) + "\n\n" + QUESTION}]
        extra = {"kv_transfer_params": {"documents": ids}}
        plain = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=8,
                                               temperature=0, extra_body=extra)
        assert plain.model_extra["kv_transfer_params"]["cachetune"]["documents"] == ids
        assert plain.usage.prompt_tokens_details.cached_tokens > sum(d["tokens"] for d in documents) // 2
        streamed = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=8,
                                                  temperature=0, extra_body=extra, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == plain.choices[0].message.content and text
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert _metric(metrics, "vllm:cachetune_blended_requests_total") == 2
        assert _metric(metrics, "vllm:cachetune_recomputed_by_vllm_total") == 0
    finally:
        served.stop()
