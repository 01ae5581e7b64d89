"""KVLink's link tokens: full reuse plus trained links after every document, served as trained."""

from __future__ import annotations

import pytest
import torch

from cachetune.kvlink.links import LinkConfig, LinkTokens, link_layout
from cachetune.methods import make_method
from cachetune.train.kvlink import kvlink_logits
from cachetune.train.objective import Sample
from conftest import alone_then_added, assert_close, rand_ids, served_answer_logits, tiny_engine, train_steps, words


def test_links_follow_every_cached_segment_at_positions_of_their_own():
    reused, links, text, total = link_layout([3, 5, 4, 2], [False, True, True, False], 2)
    assert reused == [(1, 3), (2, 10)] and text == [(0, 0), (3, 16)]
    assert links.tolist() == [8, 9, 14, 15] and total == 18


def _parts(engine, docs, question="q"):
    ids = [engine.cache_chunk(d) for d in docs]
    head, after = engine.template.segments("sys", question)
    return ids, head, after


def test_training_sees_what_serving_computes():
    engine = tiny_engine(threads=None)
    links = engine.extractors.get("step0", LinkTokens).tokens
    with torch.no_grad():
        links.embedding.add_(0.3 * torch.randn(links.embedding.shape, generator=torch.Generator().manual_seed(0)))
    docs = [words(23, 1), words(11, 2), words(7, 3)]
    ids, head, after = _parts(engine, docs, words(4, 3))
    answer = rand_ids(4, 4)
    sample = Sample(head, [engine.tokenize(d) for d in docs], after, answer)
    prompt = engine.prompt_from(head, ids, after)
    with torch.no_grad():
        trained = kvlink_logits(engine.adapter, links, sample)
        served, forced = served_answer_logits(engine, prompt, "kvlink:step0", answer)
    assert_close(forced, trained[-answer.numel():], 1e-4, "answer logits")
    assert served.prompt_rows == prompt.total + 15 == served.cache.length - 3  # 3 answer tokens extended
    assert served.reused_rows == 23 + 11 + 7  # every document row is reused, none recomputed


def test_a_link_sees_its_own_and_earlier_documents_only():
    engine = tiny_engine(threads=None)
    docs = [words(20, 5), words(12, 6)]
    ids, head, after = _parts(engine, docs)
    base = engine.prefill(engine.prompt_from(head, ids, after), "kvlink:step0").cache
    changed_second = [ids[0], engine.cache_chunk(words(12, 7))]
    other = engine.prefill(engine.prompt_from(head, changed_second, after), "kvlink:step0").cache
    first_links = slice(head.numel() + 20, head.numel() + 25)
    assert torch.equal(base.keys[:, first_links], other.keys[:, first_links])
    second_links = slice(head.numel() + 37, head.numel() + 42)
    assert not torch.allclose(base.keys[1:, second_links], other.keys[1:, second_links])


def test_training_the_links_lowers_the_loss_and_changes_only_them():
    engine = tiny_engine(threads=None)
    links = LinkTokens(engine.adapter, LinkConfig(), "tiny", 2)
    assert set(links.trainable()) == {"embedding"} and links.embedding.shape == (5, 64)
    sample = Sample(rand_ids(5, 1), [rand_ids(15, 2), rand_ids(9, 3)], rand_ids(4, 4), rand_ids(3, 5))
    before = [p.clone() for p in engine.model.parameters()]
    start, end = train_steps(engine, links, sample, kvlink_logits, lr=5e-2, steps=10)
    assert end < start - 0.05
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))


def test_kvlink_serves_in_a_batch_like_alone():
    engine = tiny_engine(threads=None)
    alone, reqs = alone_then_added(engine, "kvlink:step0")
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == alone


def test_a_link_count_other_than_the_files_is_a_clear_error():
    engine = tiny_engine(threads=None)
    ids, head, after = _parts(engine, [words(9, 8)])
    with pytest.raises(ValueError, match="pass count=5"):
        engine.prefill(engine.prompt_from(head, ids, after), make_method("kvlink:step0", count=3))


def test_export_casts_a_links_file_and_refuses_another_kind(tmp_path, capsys):
    from cachetune.c2kv.tokens import read_tokens_file
    from cachetune.cli import main

    engine = tiny_engine(threads=None)
    links = engine.extractors.get("step0", LinkTokens).tokens
    src, dst = tmp_path / "links.safetensors", tmp_path / "shipped.safetensors"
    links.save(src)
    assert main(["kvlink", "export", str(src), str(dst)]) == 0
    _, tensors = read_tokens_file(dst, LinkTokens.FORMAT)
    assert tensors["embedding"].dtype == torch.bfloat16
    assert torch.equal(tensors["embedding"], links.embedding.detach().to(torch.bfloat16))
    assert main(["c2kv", "export", str(src), str(tmp_path / "wrong.safetensors")]) == 2
    assert "error" in capsys.readouterr().err and not (tmp_path / "wrong.safetensors").exists()


def test_a_request_names_only_shipped_step0_or_configured_links(tmp_path):
    from cachetune.config import EngineConfig
    from cachetune.methods import check_request_method

    path = str(tmp_path / "links.safetensors")
    for spec in ["kvlink", "kvlink:step0", "kvlink:bundled", "kvlink:links=step0:count=5"]:
        check_request_method(spec, EngineConfig())
    for spec in [f"kvlink:{path}", f"kvlink:links={path}", "kvlink:/etc/shadow", "kvlink:step1"]:
        with pytest.raises(ValueError, match="may set links only to one of 'bundled', 'paper', 'step0'"):
            check_request_method(spec, EngineConfig())
    check_request_method(f"kvlink:{path}", EngineConfig(kvlink_links=path))  # the operator's file
    with pytest.raises(ValueError, match="count must be an integer in"):
        make_method("kvlink:step0:count=1000000")
