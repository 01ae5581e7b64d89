"""Training the C2KV extractor on tiny models: the loss falls, only the extractor changes, a resumed
run equals an uninterrupted one, training sees exactly what serving computes, and the split holds."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from cachetune.c2kv.extractor import C2Extractor, ExtractorConfig
from cachetune.eval.datasets import QAExample
from cachetune.train.c2kv import c2kv_logits
from cachetune.train.objective import Sample, sample_loss
from cachetune.train.data import draw, split_examples
from cachetune.train.loop import STATE, WEIGHTS, TrainConfig, Trainer, learning_rate, plot_history
from cachetune.runtime.decode import SamplingConfig
from conftest import assert_close, rand_ids, served_answer_logits, tiny_engine, words

EOS = 2


def _weights_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode() + p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _sample(seed: int) -> Sample:
    return Sample(rand_ids(6, seed), [rand_ids(17, seed + 1), rand_ids(9, seed + 2)], rand_ids(5, seed + 3),
                  rand_ids(3, seed + 4))


def _setup(lora_rank: int = 0, seed: int = 0):
    engine = tiny_engine(threads=None)
    extractor = C2Extractor(engine.adapter, ExtractorConfig(lora_rank=lora_rank), "tiny", EOS)
    return engine, extractor


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_training_steps_lower_the_loss_and_change_only_the_extractor(lora_rank):
    engine, extractor = _setup(lora_rank)
    base = _weights_hash(engine.model)
    frozen = {n: p.detach().clone() for n, p in extractor.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in extractor.trainable().items()}
    batch = [_sample(10 * i) for i in range(2)]
    optimizer = torch.optim.AdamW(list(extractor.trainable().values()), lr=3e-3)

    def loss() -> torch.Tensor:
        return sum(sample_loss(engine.adapter, extractor, s, c2kv_logits) for s in batch) / len(batch)

    with torch.enable_grad():
        start = float(loss().detach())
        for _ in range(8):
            optimizer.zero_grad()
            value = loss()
            value.backward()
            assert all(p.grad is None for p in engine.model.parameters())
            optimizer.step()
        end = float(loss().detach())
    assert end < start - 0.05
    assert _weights_hash(engine.model) == base
    assert all(torch.equal(p, frozen[n]) for n, p in extractor.named_parameters() if n in frozen)
    # Every trainable tensor moved, except the last layer's C2 query: only C2 K/V are kept, so what the
    # last layer's C2Tokens attend to reaches no output (it gets no gradient at all).
    last = f"q.{engine.adapter.num_layers - 1}."
    moved = {n for n, p in extractor.trainable().items() if not torch.equal(p, before[n])}
    assert moved == {n for n in before if not n.startswith(last)} and moved


def test_training_sees_what_serving_computes():
    engine, _ = _setup()
    extractor = engine.extractors.get("step0").tokens
    docs = [words(23, 1), words(11, 2)]
    ids = [engine.cache_chunk(d) for d in docs]
    head, question = engine.template.segments("sys", words(4, 3))
    answer = rand_ids(4, 4)
    sample = Sample(head, [engine.tokenize(d) for d in docs], question, answer)
    with torch.no_grad():
        trained = c2kv_logits(engine.adapter, extractor, sample)
        _, teacher_forced = served_answer_logits(engine, engine.prompt_from(head, ids, question), "c2kv:step0", answer)
    assert_close(teacher_forced, trained[-answer.numel():], 1e-4, "answer logits")


def test_distillation_adds_the_kl_to_the_full_context_model():
    engine, extractor = _setup()
    sample = _sample(3)
    with torch.no_grad():
        ce, kd, both = (float(sample_loss(engine.adapter, extractor, sample, c2kv_logits, loss)) for loss in ("ce", "kd", "ce+kd"))
        weighted = float(sample_loss(engine.adapter, extractor, sample, c2kv_logits, "ce+kd", ce_weight=0.25))
    assert kd > 0 and both == pytest.approx(ce + kd, rel=1e-5)
    assert weighted == pytest.approx(0.25 * ce + kd, rel=1e-5)
    with pytest.raises(ValueError, match="loss must be"):
        sample_loss(engine.adapter, extractor, sample, c2kv_logits, "mse")


def test_tail_distillation_covers_the_question_positions_too():
    engine, extractor = _setup()
    sample = _sample(5)
    a, tail = sample.answer.numel(), sample.question.numel() + sample.answer.numel()
    with torch.no_grad():
        logits = c2kv_logits(engine.adapter, extractor, sample)
        answer, every = (float(sample_loss(engine.adapter, extractor, sample, c2kv_logits, "kd", span))
                         for span in ("answer", "tail"))
        # the same KL by hand, per position, from the full-context model run on the whole prompt
        full = engine.model(input_ids=sample.full[None]).logits[0, -tail:-1].float()
        per_row = (full.softmax(-1) * (full.log_softmax(-1) - logits.float().log_softmax(-1))).sum(-1)
    assert logits.shape[0] == tail - 1
    assert answer == pytest.approx(float(per_row[-a:].mean()), rel=1e-4)
    assert every == pytest.approx(float(per_row.mean()), rel=1e-4) and every != pytest.approx(answer, rel=1e-3)
    with pytest.raises(ValueError, match="kd_span must be"):
        sample_loss(engine.adapter, extractor, sample, c2kv_logits, "kd", "question")
    with pytest.raises(ValueError, match="kd_span one of"):
        TrainConfig(loss="kd", kd_span="all")


def _trainer(out, steps: int, extractor, engine, seed: int = 0):
    cfg = TrainConfig(steps=steps, accumulate=2, lr=3e-3, warmup=1, eval_every=2, eval_examples=1, save_every=1)
    samples = [_sample(100 + i) for i in range(8)]

    def loss_fn(step, index):
        return sample_loss(engine.adapter, extractor, samples[(step * 2 + index) % len(samples)], c2kv_logits)

    def heldout():
        with torch.no_grad():
            return float(sample_loss(engine.adapter, extractor, _sample(999), c2kv_logits))

    return Trainer(out, cfg, extractor.trainable(), loss_fn, heldout, lambda path, meta: extractor.save(path, meta),
                   {"test": seed})


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    engine, straight = _setup()
    _trainer(tmp_path / "a", 4, straight, engine).run()
    _, first = _setup()
    state = _trainer(tmp_path / "b", 4, first, engine).run(max_steps=2)
    assert state["step"] == 2 and not state["done"]
    _, resumed = _setup()  # a fresh process: new, untrained tensors, then the checkpoint
    trainer = _trainer(tmp_path / "b", 4, resumed, engine)
    assert trainer.resume() and trainer.step == 2
    assert trainer.run()["done"]
    for name, p in straight.trainable().items():
        assert_close(p, resumed.trainable()[name], 1e-5, name)
    loaded = C2Extractor.load(tmp_path / "b" / WEIGHTS, engine.adapter, "tiny", EOS)
    assert loaded.fingerprint() == resumed.fingerprint()
    history = json.loads((tmp_path / "b" / STATE).read_text())["history"]
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4] and "heldout" in history[2]
    assert plot_history(history, tmp_path / "curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="another run"):
        _trainer(tmp_path / "b", 4, resumed, engine, seed=1).resume()
    with pytest.raises(ValueError, match="planned for 4 steps"):
        _trainer(tmp_path / "b", 5, resumed, engine).resume()


def test_the_schedule_warms_up_then_decays_by_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0) == pytest.approx(0.1) and learning_rate(cfg, 9) == pytest.approx(1.0)
    assert learning_rate(cfg, 10) == pytest.approx(1.0)
    assert learning_rate(cfg, 55) == pytest.approx(0.55)
    assert learning_rate(cfg, 100) == pytest.approx(0.1)
    lrs = [learning_rate(cfg, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def _examples(n: int) -> list[QAExample]:
    return [QAExample(f"x-{i}", [f"doc {i}.{j}" for j in range(10)], f"q{i}", [f"a{i}"], supporting=(2, 7))
            for i in range(n)]


def test_the_heldout_split_is_fixed_and_disjoint_and_draws_vary_the_layout():
    examples = _examples(50)
    split = split_examples(examples, heldout=10, seed=0)
    assert split == split_examples(examples, heldout=10, seed=0)
    assert len(split.heldout) == 10 and len(split.train) == 40
    assert not {e.id for e in split.heldout} & {e.id for e in split.train}
    draws = [draw(split.train, 0, step) for step in range(40)]
    assert draws[5] == draw(split.train, 0, 5)  # a pure function of (seed, step): resumable
    for d in draws:
        docs = d.example.documents
        assert docs[2] in d.documents and docs[7] in d.documents  # supporting documents always present
    assert len({len(d.documents) for d in draws}) > 3          # distractor counts vary
    assert len({tuple(d.documents) for d in draws}) == len(draws)
    with pytest.raises(ValueError, match="heldout"):
        split_examples(examples, heldout=50)


def test_the_real_training_set_is_hotpotqa_and_its_heldout_split_is_stable():
    from cachetune.eval.datasets import shared_data_dir
    from cachetune.train.data import load_split

    if shared_data_dir() is None:
        pytest.skip("shared data not present")
    split = load_split()
    assert len(split.heldout) == 100 and len(split.train) == 400
    assert all(len(e.supporting) == 2 for e in split.train)


@pytest.mark.parametrize("kind", ["c2kv", "kvlink", "block_attention"])
def test_a_training_run_on_the_real_split_writes_weights_the_engine_serves(kind, tmp_path):
    from cachetune.blockattn.model import BlockAttentionConfig, BlockAttentionModel
    from cachetune.eval.datasets import shared_data_dir
    from cachetune.kvlink.links import LinkConfig, LinkTokens
    from cachetune.train.run import train_tokens

    if shared_data_dir() is None:
        pytest.skip("shared data not present")
    engine = tiny_engine(threads=None)
    cls, config = {"c2kv": (C2Extractor, ExtractorConfig(lora_rank=2)), "kvlink": (LinkTokens, LinkConfig()),
                   "block_attention": (BlockAttentionModel, BlockAttentionConfig(lora_rank=2))}[kind]
    cfg = TrainConfig(steps=2, accumulate=1, warmup=1, eval_every=1, eval_examples=1, save_every=1)
    state = train_tokens(engine, tmp_path, cfg, cls, config)
    assert state["done"] and state["step"] == 2 and state["heldout"] > 0
    ids = [engine.cache_chunk(words(20, 1)), engine.cache_chunk(words(9, 2))]
    out = engine.generate(ids, words(3, 3), method=f"{kind}:{tmp_path / WEIGHTS}",
                          sampling=SamplingConfig(max_new_tokens=2))
    assert out.token_ids and out.method == f"{kind}:{tmp_path / WEIGHTS}"


def test_a_warm_start_begins_from_the_given_weights_and_refuses_another_layout(tmp_path):
    from cachetune.eval.datasets import shared_data_dir
    from cachetune.train.run import train_tokens

    if shared_data_dir() is None:
        pytest.skip("shared data not present")
    engine = tiny_engine(threads=None)
    cfg = TrainConfig(steps=1, accumulate=1, warmup=1, eval_every=1, eval_examples=1, save_every=1)
    first = train_tokens(engine, tmp_path / "a", cfg, C2Extractor, ExtractorConfig(lora_rank=2))
    warm = TrainConfig(**{**cfg.__dict__, "init": str(tmp_path / "a" / WEIGHTS)})
    train_tokens(engine, tmp_path / "b", warm, C2Extractor, ExtractorConfig(lora_rank=2), max_steps=0)
    state = json.loads((tmp_path / "b" / STATE).read_text())
    history = state["history"]
    # the run is named by its extractor's config and where it started
    assert state["identity"]["extractor"]["lora_rank"] == 2 and state["identity"]["init"] == warm.init
    assert history[0]["heldout"] == pytest.approx(first["heldout"], rel=1e-6)  # step 0 of b = the end of a
    with pytest.raises(ValueError, match="not this run's"):
        train_tokens(engine, tmp_path / "c", warm, C2Extractor, ExtractorConfig(lora_rank=4))
