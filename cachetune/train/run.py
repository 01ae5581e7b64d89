"""One training run of a trained reuse method's tokens (C2KV's extractor, KVLink's links) on HotpotQA.

    cachetune c2kv train --out runs/c2kv --steps 400        # or: cachetune kvlink train --out runs/kvlink

The base model is frozen; the run trains `kind`'s tokens with the shared loop (train.loop: AdamW,
warm-up + cosine, clipping, resumable checkpoints) on draws from the training split, and reports the
held-out loss over the first `eval_examples` held-out rows served with all their documents.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from cachetune.blockattn.model import BlockAttentionModel
from cachetune.c2kv.extractor import C2Extractor
from cachetune.kvlink.links import LinkTokens
from cachetune.model.loader import weights_identity
from cachetune.train.blockattn import block_attention_logits
from cachetune.train.c2kv import c2kv_logits
from cachetune.train.data import HELDOUT, SPLIT_SEED, draw, heldout_draw, load_split
from cachetune.train.kvlink import kvlink_logits
from cachetune.train.loop import TrainConfig, Trainer
from cachetune.train.objective import LogitsFn, build_sample, sample_loss

# kind -> (what the student computes, the run identity's name for the tokens' config)
STUDENTS: dict[type, tuple[LogitsFn, str]] = {C2Extractor: (c2kv_logits, "extractor"),
                                               LinkTokens: (kvlink_logits, "links"),
                                               BlockAttentionModel: (block_attention_logits, "lora")}


def heldout_loss(engine, tokens, logits_fn: LogitsFn, examples, loss: str = "ce", kd_span: str = "answer",
                 ce_weight: float = 1.0) -> float:
    """Mean training loss over held-out examples served with all their documents (no grad)."""
    with torch.no_grad():
        values = [float(sample_loss(engine.adapter, tokens, build_sample(engine, heldout_draw(ex)), logits_fn,
                                    loss, kd_span, ce_weight)) for ex in examples]
    return sum(values) / len(values)


def train_tokens(engine, out, cfg: TrainConfig, kind: type, config, heldout: int | None = None,
                 split_seed: int | None = None, max_steps: int | None = None) -> dict:
    """Train (or resume) `kind`'s tokens with `config` for `engine`'s model into `out`."""
    heldout = HELDOUT if heldout is None else heldout
    split_seed = SPLIT_SEED if split_seed is None else split_seed
    split = load_split(heldout, split_seed)
    logits_fn, name = STUDENTS[kind]
    engine.model.requires_grad_(False)
    identity_of_base = weights_identity(engine.model)
    tokens = kind(engine.adapter, config, identity_of_base, engine.eos_id())
    if cfg.init is not None:  # a warm start; a checkpoint in `out`, if any, still wins (resume)
        start = kind.load(cfg.init, engine.adapter, identity_of_base, engine.eos_id())
        if start.config != config:
            raise ValueError(f"{cfg.init}: its config {start.config} is not this run's {config}")
        with torch.no_grad():
            for tensor_name, p in tokens.trainable().items():
                p.copy_(start.trainable()[tensor_name])
    tokens.train()
    eval_set = split.heldout[: cfg.eval_examples]

    def loss_fn(step: int, index: int) -> torch.Tensor:
        sample = build_sample(engine, draw(split.train, cfg.seed, step, index))
        return sample_loss(engine.adapter, tokens, sample, logits_fn, cfg.loss, cfg.kd_span, cfg.ce_weight)

    def save_weights(path, meta) -> None:
        tokens.save(path, {**meta, "train": {"heldout": heldout, "split_seed": split_seed, **asdict(cfg)}})

    identity = {"model": engine.name, "dtype": engine.config.dtype, "method": kind.VARIANT, name: asdict(config),
                "heldout": heldout, "split_seed": split_seed}
    if cfg.init is not None:
        identity["init"] = cfg.init
    trainer = Trainer(out, cfg, tokens.trainable(), loss_fn,
                      lambda: heldout_loss(engine, tokens, logits_fn, eval_set, cfg.loss, cfg.kd_span, cfg.ce_weight),
                      save_weights, identity)
    trainer.resume()
    return trainer.run(max_steps)
