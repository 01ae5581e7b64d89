"""Turn (system, chunks, question) into token segments using the model's own chat template.

The template is rendered once with a placeholder where the documents go and split there, so the text
before the documents (template start, system prompt, user-turn header) and after them (question,
turn end, assistant header) are tokenized as their own segments. The placeholder never reaches the
model; chunk spans stay explicit. A tokenizer without a chat template gets the plain format
"{system}\n\n" + documents + "Question: {question}\nAnswer:".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_SYSTEM = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words."
)
QUESTION_LABEL = "Question: "
_PLACEHOLDER = "\u2063CACHETUNE_DOCUMENTS\u2063"


@dataclass
class PromptTemplate:
    tokenizer: object

    def split(self, system: str, question: str, label: str = QUESTION_LABEL) -> tuple[str, str]:
        """Text before and after the documents; `label` goes before the question ("" for a prompt
        whose question text is already complete, e.g. a LongBench query or a summary instruction)."""
        question_text = f"{label}{question}"
        if not getattr(self.tokenizer, "chat_template", None):
            return f"{system}\n\n", f"{question_text}\nAnswer:" if label else question_text
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": _PLACEHOLDER + question_text},
        ]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, sep, after = rendered.partition(_PLACEHOLDER)
        if not sep:
            raise ValueError("the chat template dropped the user message; cannot place documents")
        return before, after

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of `text` exactly as written (special tokens in the text are parsed, none added)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)

    def segments(self, system: str, question: str, label: str = QUESTION_LABEL) -> tuple[torch.Tensor, torch.Tensor]:
        before, after = self.split(system, question, label)
        return self.encode(before), self.encode(after)
