"""Inputs that used to break the server or other requests: each answer is a clear 4xx (or a normal
answer) that touches no other request, found before any engine work where it can be."""

from __future__ import annotations

import threading

import httpx
import pytest

from conftest import words
from test_server import DOCS, SLOW_TOKENS, Served, _slow_chat, _wait, slow_engine
from cachetune.config import ServerConfig
from cachetune.runtime.decode import SamplingConfig, sample

import torch


@pytest.mark.parametrize("temperature,top_p", [(1e-38, 1.0), (1.0, 1e-46), (5e-324, 1e-300), (1e-30, 0.5)])
def test_tiny_temperatures_and_top_ps_sample_the_top_token(temperature, top_p):
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 30
    config = SamplingConfig(4, temperature, top_p, seed=3)
    assert sample(logits, config, config.generator()) == int(logits.argmax())


def test_a_tiny_temperature_beside_a_streamed_request_leaves_both_whole():
    with Served(ServerConfig(max_tokens=SLOW_TOKENS), engine=slow_engine()) as s:
        with s.http.stream("POST", "/v1/chat/completions", json=_slow_chat(300)) as streamed:
            lines = streamed.iter_lines()
            assert next(lines).startswith("data: ")
            for body in ({"prompt": "w1", "max_tokens": 2, "temperature": 1e-38},
                         {"prompt": "w1", "max_tokens": 2, "top_p": 1e-46}):
                r = s.http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        assert '"finish_reason": "length"' in rest[-2] or '"finish_reason":"length"' in rest[-2]
        assert s.metric("cachetune:request_errors_total", '{kind="engine"}') == 0


class LongestTokenized:
    """A tokenizer stand-in that remembers the longest text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_an_oversized_prompt_is_refused_before_it_is_tokenized():
    text = "w1 " * 2_500_000  # 7.5 MB: thousands of times what the tiny model's context holds
    with Served(ServerConfig(max_body_bytes=16 * 2**20)) as s:
        spy = s.engine.template.tokenizer = LongestTokenized(s.engine.template.tokenizer)
        for endpoint, body in (("/v1/completions", {"prompt": text, "max_tokens": 1}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                         "max_tokens": 1})):
            r = s.http.post(endpoint, json=body)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["param"] in ("prompt", "messages")
        assert spy.longest < 1000  # no tokenizing of the text at all
        ok = s.http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1})
        assert ok.status_code == 200
        assert spy.longest == len("w1 w2")  # the spy does see what the server tokenizes


def test_inline_documents_over_the_limit_are_refused_before_any_is_encoded(served_plain):
    s = served_plain
    body = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 1,
            "documents": [words(600, 1), {"text": words(600, 2)}]}
    r = s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 413, r.text
    assert s.engine.chunks_encoded == 0


def test_document_registration_counts_toward_the_queue_bound():
    long_docs = [words(3000, seed) for seed in (21, 22, 23)]
    with Served(ServerConfig(max_queue=1), engine=slow_engine()) as s:
        answers = []
        first = threading.Thread(target=lambda: answers.append(s.http.post("/v1/documents",
                                                                           json={"texts": long_docs})))
        first.start()
        assert _wait(lambda: s.metric("cachetune:num_requests_waiting") >= 1)
        refused = s.http.post("/v1/documents", json={"texts": [words(10, 5)]})
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert s.http.post("/v1/chat/completions", json=_slow_chat(1)).status_code == 429
        first.join(120)
        assert answers and answers[0].status_code == 200 and len(answers[0].json()["data"]) == 3
        assert s.http.post("/v1/documents", json={"texts": [words(10, 5)]}).status_code == 200


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%20", "/x"])
def test_a_document_id_with_anything_after_it_is_not_found(tmp_path, suffix):
    with Served(tiers=f"cpu,disk:{tmp_path}") as s:  # the disk tier names files by id
        cid = s.register(DOCS[0])[0]
        for verb in ("GET", "DELETE"):
            r = s.http.request(verb, f"/v1/documents/{cid}{suffix}")
            assert r.status_code == 404, (verb, r.text)
        assert s.http.get(f"/v1/documents/{cid}").status_code == 200


def test_a_request_naming_a_file_as_weights_learns_nothing_about_the_file_system(served_plain, tmp_path):
    real = tmp_path / "weights.safetensors"
    real.write_bytes(b"x")
    messages = []
    for path in (real, tmp_path / "missing.safetensors", "/etc/shadow"):
        for spec in (f"c2kv:{path}", f"block_attention:{path}", f"kvlink:links={path}"):
            r = served_plain.http.post("/v1/completions", json={"prompt": "w1", "method": spec})
            assert r.status_code == 400 and r.json()["error"]["param"] == "method"
            messages.append(r.json()["error"]["message"].replace(str(path), "PATH"))
    assert len({m.split(":")[0] for m in messages}) <= 3 and not any("exist" in m for m in messages)
    assert all(messages[i] == messages[i + 3] == messages[i + 6] for i in range(3))


def test_without_an_api_key_only_loopback_host_names_are_served():
    with Served() as s:
        for host in ("evil.example", "evil.example:8000", "10.0.0.1"):
            r = s.http.get("/v1/models", headers={"Host": host})
            assert r.status_code == 403, host
            assert s.http.get("/metrics", headers={"Host": host}).status_code == 403
        for host in ("localhost", "127.0.0.1:8000", "[::1]:8000"):
            assert s.http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    with Served(ServerConfig(api_key="k")) as s:  # with a key, the key decides
        assert s.http.get("/v1/models", headers={"Host": "models.example"}).status_code == 200


@pytest.fixture
def served_plain():
    with Served() as s:
        yield s


def test_health_stays_open_to_any_host():
    with Served() as s:
        assert httpx.get(f"{s.url}/health", headers={"Host": "evil.example"}).status_code == 200
