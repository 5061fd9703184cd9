"""From an input row to prompt token ids: the recipe's template, the chat template, truncation.

`{field}` placeholders of `prompt.template` are filled from the row's columns (a list of strings, such
as RAG passages, is joined with blank lines). With `prompt.chat`, the filled text becomes the user
message of the model's chat template (after `prompt.system`, if set). Rows in the OpenAI batch format
bring their own prompt or messages. Token ids are `tokenizer(text)` with the tokenizer's default
special tokens, or the chat template's own tokenisation. Problems with a row raise `RowError`.
This module does not read files or run models.
"""

from __future__ import annotations

import string
from typing import Any

from engine.config.schema import PromptConfig
from engine.errors import JobError, RowError


class PromptBuilder:
    def __init__(self, config: PromptConfig, tokenizer: Any, *, max_prompt_len: int | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len  # only used with prompt.truncate: left
        self.fields = template_fields(config.template)
        if config.chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise JobError("prompt.chat: the model's tokenizer has no chat template")

    def text(self, data: dict[str, Any]) -> str:
        """The filled template."""
        values = {}
        for name in self.fields:
            if name not in data:
                raise RowError(f"missing column '{name}' used by the template")
            values[name] = _as_text(data[name], name)
        return self.config.template.format_map(values)

    def token_ids(self, data: dict[str, Any], openai: dict[str, Any] | None = None,
                  max_new_tokens: int | None = None) -> list[int]:
        if openai is not None:
            if openai.get("messages") is not None:
                ids = self._chat(openai["messages"])
            else:
                ids = self.tokenizer(openai["prompt"])["input_ids"]
        elif self.config.chat:
            messages = [{"role": "user", "content": self.text(data)}]
            if self.config.system:
                messages.insert(0, {"role": "system", "content": self.config.system})
            ids = self._chat(messages)
        else:
            ids = self.tokenizer(self.text(data))["input_ids"]
        return self._truncate(list(ids), max_new_tokens)

    def _chat(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors are the row's problem
            raise RowError(f"chat template failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def _truncate(self, ids: list[int], max_new_tokens: int | None) -> list[int]:
        if self.config.truncate != "left" or self.max_prompt_len is None or max_new_tokens is None:
            return ids
        room = self.max_prompt_len - max_new_tokens
        if room < 1:
            raise RowError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in batch.max_len")
        return ids[-room:] if len(ids) > room else ids


def template_fields(template: str) -> list[str]:
    """The column names a template uses; raises JobError on a malformed template."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise JobError(f"prompt.template: {exc}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise JobError(f"prompt.template: '{{{name}}}' must name a column (use {{{{ }}}} for literal braces)")
        if name not in fields:
            fields.append(name)
    return fields


def _as_text(value: Any, name: str) -> str:
    if value is None:
        raise RowError(f"column '{name}' is empty")
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n\n".join(value)
    if isinstance(value, (int, float, bool)):
        return str(value)
    raise RowError(f"column '{name}' is a {type(value).__name__}, not text")
