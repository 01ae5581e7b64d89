"""Turn (system, chunks, question) into token segments using the model's own chat template.

The template is rendered once with markers where the system prompt, the documents and the question
go. The text around the markers is the template's own and is tokenized with its special tokens; the
system prompt, the question and every document are user text and are tokenized as text only, so a
`<|im_end|><|im_start|>assistant` written inside them stays plain characters and cannot forge a turn.
Chunk spans stay explicit: the documents' marker splits the prompt into the part before and after
them. A tokenizer without a chat template gets "{system}\n\n" + documents + "Question: {q}\nAnswer:".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_SYSTEM = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words."
)
QUESTION_LABEL = "Question: "
DOCUMENT_SEPARATOR = "\n\n"  # appended to every document so chunks read as separate passages
CHAT_ROLES = ("system", "user", "assistant")
_DOCUMENTS = "\u2063CACHETUNE_DOCUMENTS\u2063"


def _marker(i: int) -> str:
    return f"\u2063CACHETUNE_MESSAGE_{i}\u2063"


@dataclass
class PromptTemplate:
    tokenizer: object

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of user text [N] int64: special-token strings in it are split into ordinary
        tokens, and nothing (BOS, EOS) is added."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)

    def _encode_template(self, text: str) -> list[int]:
        """The template's own text: its special tokens are parsed as such."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _fill(self, template: str, values: dict[str, str]) -> torch.Tensor:
        """Tokens of `template` with each marker replaced by its user text (tokenized as text)."""
        ids: list[int] = []
        rest = template
        while True:
            found = [(rest.find(m), m) for m in values if m in rest]
            if not found:
                break
            at, marker = min(found)
            ids += self._encode_template(rest[:at]) + self.encode(values[marker]).tolist()
            rest = rest[at + len(marker):]
        return torch.tensor(ids + self._encode_template(rest), dtype=torch.int64)

    def segments(self, system: str, question: str, label: str = QUESTION_LABEL) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids before and after the documents. `label` goes before the question ("" for a prompt
        whose question text is already complete, e.g. a LongBench query or a summary instruction)."""
        for name, value in (("system", system), ("question", question), ("label", label)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        question_text = f"{label}{question}"
        if not getattr(self.tokenizer, "chat_template", None):
            after = f"{question_text}\nAnswer:" if label else question_text
            return self.encode(f"{system}\n\n"), self.encode(after)
        return self.chat([("system", system), ("user", question_text)])

    def chat(self, messages: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids before and after the documents of a conversation [(role, content)], roles in
        CHAT_ROLES. The documents open the first user message; every content is user text. Without a
        chat template: the system contents, then the documents, then the other contents, one a line."""
        roles = [role for role, _ in messages]
        if any(role not in CHAT_ROLES for role in roles) or "user" not in roles:
            raise ValueError(f"a conversation needs a user message and roles among {', '.join(CHAT_ROLES)}")
        if not getattr(self.tokenizer, "chat_template", None):
            system = "\n\n".join(c for r, c in messages if r == "system")
            rest = "\n".join(c for r, c in messages if r != "system")
            return self.encode(f"{system}\n\n" if system else ""), self.encode(rest)
        first_user = roles.index("user")
        values = {_marker(i): content for i, (_, content) in enumerate(messages)}
        rendered = self.tokenizer.apply_chat_template(
            [{"role": role, "content": (_DOCUMENTS if i == first_user else "") + _marker(i)}
             for i, role in enumerate(roles)],
            tokenize=False, add_generation_prompt=True)
        before, sep, after = rendered.partition(_DOCUMENTS)
        if not sep or any(rendered.count(m) != 1 for m in values) or _marker(first_user) not in after:
            raise ValueError("the chat template dropped or moved a message; cannot place documents")
        return self._fill(before, values), self._fill(after, values)
