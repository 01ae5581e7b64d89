"""Block-Attention: a LoRA fine-tune of a copy of the model, serving its own chunk KV and decoding."""

from __future__ import annotations

import torch

from cachetune.blockattn.model import BlockAttentionConfig, BlockAttentionModel
from cachetune.train.blockattn import block_attention_logits, block_mask
from cachetune.train.objective import Sample
from conftest import assert_close, rand_ids, served_answer_logits, tiny_engine, train_steps, words


def test_the_block_mask_keeps_blocks_apart_and_lets_the_tail_see_all():
    visible = block_mask([2, 3], 2)
    assert visible.tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]


def _trained_file(engine, tmp_path, seed: int = 0):
    tuned = BlockAttentionModel(engine.adapter, BlockAttentionConfig(lora_rank=2), engine.extractors.base_identity, 2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tuned.trainable().values():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    path = tmp_path / "ba.safetensors"
    tuned.save(path)
    return tuned, str(path)


def test_step0_is_full_reuse_with_the_base_model():
    engine = tiny_engine(threads=None)
    ids = [engine.cache_chunk(words(n, 40 + n)) for n in (21, 13)]
    layout = engine.build_prompt(ids, words(4, 1))
    assert_close(engine.prefill(layout, "full_reuse").logits, engine.prefill(layout, "block_attention:step0").logits,
                 1e-5, "logits")


def test_training_sees_what_serving_computes(tmp_path):
    engine = tiny_engine(threads=None)
    tuned, path = _trained_file(engine, tmp_path)
    docs = [words(23, 1), words(11, 2)]
    ids = [engine.cache_chunk(d) for d in docs]
    head, question = engine.template.segments("sys", words(4, 3))
    answer = rand_ids(4, 4)
    sample = Sample(head, [engine.tokenize(d) for d in docs], question, answer)
    with torch.no_grad():
        trained = block_attention_logits(engine.adapter, tuned, sample)
        served, forced = served_answer_logits(engine, engine.prompt_from(head, ids, question),
                                              f"block_attention:{path}", answer)
    assert_close(forced, trained[-answer.numel():], 1e-4, "answer logits")
    assert not torch.allclose(served.logits, engine.prefill(engine.prompt_from(head, ids, question),
                                                            "full_reuse").logits)


def test_training_changes_only_the_adapters_of_the_copy():
    engine = tiny_engine(threads=None)
    tuned = BlockAttentionModel(engine.adapter, BlockAttentionConfig(lora_rank=2), "tiny", 2)
    before = [p.clone() for p in engine.model.parameters()]
    names = set(tuned.trainable())
    assert names and all("lora_" in n for n in names)
    sample = Sample(rand_ids(5, 1), [rand_ids(15, 2), rand_ids(9, 3)], rand_ids(4, 4), rand_ids(3, 5))
    start, end = train_steps(engine, tuned, sample, block_attention_logits, lr=1e-2, steps=6)
    assert end < start - 0.05
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))


def test_its_requests_decode_on_the_fine_tune_alone_and_in_a_mixed_batch(tmp_path):
    from cachetune import SamplingConfig

    engine = tiny_engine(threads=None)
    _, path = _trained_file(engine, tmp_path)
    ids = [engine.cache_chunk(words(n, 60 + n)) for n in (33, 18, 41)]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    methods = [f"block_attention:{path}", "full_reuse", f"block_attention:{path}"]
    alone = [engine.generate(ids[i:], words(4, i), method=m, sampling=sampling).token_ids
             for i, m in enumerate(methods)]
    reqs = [engine.add_request(ids[i:], words(4, i), method=m, sampling=sampling) for i, m in enumerate(methods)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == alone
    tuned_alone = engine.generate(ids[0:], words(4, 0), method="block_attention:step0", sampling=sampling)
    assert tuned_alone.token_ids != alone[0]  # the fine-tune, not the base model, decoded it


def test_a_request_names_only_shipped_step0_or_configured_fine_tunes(tmp_path):
    """Each new file a request could name would load another copy of the model: only the operator's."""
    import pytest

    from cachetune.config import EngineConfig
    from cachetune.methods import check_request_method

    path = str(tmp_path / "ba.safetensors")
    for spec in ["block_attention", "block_attention:step0", "block_attention:bundled"]:
        check_request_method(spec, EngineConfig())
    for spec in [f"block_attention:{path}", f"block_attention:weights={path}", f"block_attention:./{path}"]:
        with pytest.raises(ValueError, match="may set weights only to one of 'bundled', 'paper', 'step0'"):
            check_request_method(spec, EngineConfig())
    check_request_method(f"block_attention:{path}", EngineConfig(block_attention_weights=path))
