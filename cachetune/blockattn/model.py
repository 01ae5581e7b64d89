"""Block-Attention's fine-tuned model: LoRA on a copy of the base model, trained so that documents
attend only within themselves while the question attends to everything.

Such a model encodes every document alone (what a chunk cache stores) and still answers well over the
concatenation, so serving is full reuse with the fine-tuned model: its own chunk KV, its own prefill
of the uncached text and its own decoding. The copy keeps the engine's model untouched; LoRA (through
`peft`, on every layer's q/k/v/o projections) is what this hardware can train, where the paper
fine-tunes every weight. At step 0 the adapters are zero, so the copy is exactly the base model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from cachetune.c2kv.tokens import TrainedFile
from cachetune.model.adapter import ModelAdapter

FORMAT = "cachetune-block-attention-lora/1"
TARGETS = r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"


@dataclass(frozen=True)
class BlockAttentionConfig:
    lora_rank: int = 16
    lora_alpha: float = 32.0

    def __post_init__(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise ValueError(f"lora_rank must be an integer >= 1, got {self.lora_rank!r}")


class BlockAttentionModel(TrainedFile, torch.nn.Module):
    """`model`: the LoRA-wrapped copy; `adapter`: a ModelAdapter over it (what serving runs)."""

    FORMAT = FORMAT
    CONFIG = BlockAttentionConfig
    VARIANT = "block_attention"
    STEP0 = {"step0": BlockAttentionConfig()}

    def __init__(self, adapter: ModelAdapter, config: BlockAttentionConfig, base_identity: str, eos_id: int):
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__()
        self.config, self.base_identity = config, base_identity
        model = copy.deepcopy(adapter.model)
        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=TARGETS),
                                model)
        self.model = model
        self.adapter = ModelAdapter(model)
        self.mark_trained()
