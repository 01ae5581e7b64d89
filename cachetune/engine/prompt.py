"""Turn (system, chunks, question) into token segments using the model's own chat template.

The template is rendered once with markers where the system prompt, the documents and the question
go. The text around the markers is the template's own and is tokenized with its special tokens; the
system prompt, the question and every document are user text and are tokenized as text only, so a
`<|im_end|><|im_start|>assistant` written inside them stays plain characters and cannot forge a turn.
Chunk spans stay explicit: the documents' marker splits the prompt into the part before and after
them. A tokenizer without a chat template gets "{system}\n\n" + documents + "Question: {q}\nAnswer:".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

DEFAULT_SYSTEM = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words."
)
QUESTION_LABEL = "Question: "
DOCUMENT_SEPARATOR = "\n\n"  # appended to every document so chunks read as separate passages
CHAT_ROLES = ("system", "user", "assistant", "tool")
_DOCUMENTS = "\u2063CACHETUNE_DOCUMENTS\u2063"


def _marker(i: int) -> str:
    return f"\u2063CACHETUNE_MESSAGE_{i}\u2063"


def _marker_call(i: int, j: int, part: str) -> str:
    return f"\u2063CACHETUNE_{part.upper()}_{i}_{j}\u2063"


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

    def document(self, text: str) -> torch.Tensor:
        """Token ids [N] of a document as a chunk: its text followed by DOCUMENT_SEPARATOR, so chunks
        placed one after another read as separate passages. Every place that caches or lays out a
        document goes through here, so the same text always gives the same chunk."""
        if not isinstance(text, str):
            raise TypeError(f"a document is text (str), got {type(text).__name__}")
        return self.encode(text + DOCUMENT_SEPARATOR)

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

    def chat(self, messages: list[tuple[str, str]], tool_calls: dict[int, list[tuple[str, str]]] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids before and after the documents of a conversation [(role, content)], roles in
        CHAT_ROLES. The documents open the first user message (or, without one, follow the last
        message's content); every content is user text. `tool_calls` maps a message's index to the
        (name, arguments JSON) calls an assistant made there: rendered by the template where it
        renders tool calls, else written as JSON lines into that message; either way text, never
        control tokens. Without a chat template: the system contents, then the documents, then the
        other contents, one a line."""
        roles = [role for role, _ in messages]
        if not messages or any(role not in CHAT_ROLES for role in roles):
            raise ValueError(f"a conversation needs messages with roles among {', '.join(CHAT_ROLES)}")
        calls = tool_calls or {}
        if not getattr(self.tokenizer, "chat_template", None):
            contents = [self._with_calls(c, calls.get(i)) for i, (_, c) in enumerate(messages)]
            system = "\n\n".join(c for (r, _), c in zip(messages, contents) if r == "system")
            rest = "\n".join(c for (r, _), c in zip(messages, contents) if r != "system")
            return self.encode(f"{system}\n\n" if system else ""), self.encode(rest)
        holder = roles.index("user") if "user" in roles else len(roles) - 1
        for folded in (False, True):  # a template that ignores tool calls gets them as text
            values = {_marker(i): self._with_calls(c, calls.get(i)) if folded else c
                      for i, (_, c) in enumerate(messages)}
            turns = []
            for i, role in enumerate(roles):
                content = _marker(i)
                content = _DOCUMENTS + content if holder == i and role == "user" else content
                content = content + _DOCUMENTS if holder == i and role != "user" else content
                turn = {"role": role, "content": content}
                if i in calls and not folded:
                    turn["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                           "function": {"name": _marker_call(i, j, "name"),
                                                        "arguments": {_marker_call(i, j, "args"): 0}}}
                                          for j in range(len(calls[i]))]
                    values.update({_marker_call(i, j, "name"): name for j, (name, _) in enumerate(calls[i])})
                    values.update({_marker_call(i, j, "args"): args for j, (_, args) in enumerate(calls[i])})
                turns.append(turn)
            rendered = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            # Arguments go in as an object whose one key is a marker: the template writes it as JSON,
            # and the whole object is replaced by the caller's arguments text.
            for key in [k for k in values if "_ARGS_" in k]:
                rendered = re.sub(r"\{\s*\"?" + re.escape(key) + r"\"?\s*:\s*0\s*\}", key, rendered)
            if all(rendered.count(m) == 1 for m in values):
                break
            if not calls or folded:
                break
        before, sep, after = rendered.partition(_DOCUMENTS)
        if not sep or any(rendered.count(m) != 1 for m in values):
            raise ValueError("the chat template dropped or moved a message; cannot place documents")
        return self._fill(before, values), self._fill(after, values)

    @staticmethod
    def _with_calls(content: str, calls: list[tuple[str, str]] | None) -> str:
        lines = [json.dumps({"name": name, "arguments": args}, ensure_ascii=False) for name, args in calls or ()]
        return "\n".join(([content] if content else []) + lines)
