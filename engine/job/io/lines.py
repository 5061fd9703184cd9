"""What one output line looks like: magicdec's own rows, or the OpenAI batch output format.

A job builds magicdec rows (`id`, `text`, `finish_reason`, `prompt_tokens`, `output_tokens`, `error`,
kept columns); `LineFormat.encode` turns one into the line the output stores. For the OpenAI batch
format (what the OpenAI Batch API and vLLM's `run-batch` write) that is `id`, `custom_id`, `response`
{`status_code`, `request_id`, `body`: a `chat.completion` or `text_completion`}, `error`. A failed
row keeps a `response` with status 400 and no body, as vLLM writes it, and `error` is {`code`,
`message`}, as in OpenAI's schema. `key_of` / `is_error` read a stored line back (resume, merges).
Nothing here touches files.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from engine.job.io.openai_batch import CHAT_URL, COMPLETIONS_URL

ERROR_CODE = "invalid_request"  # every row error magicdec writes is about the row's own request


@dataclasses.dataclass(frozen=True)
class LineFormat:
    name: str  # "magicdec" | "openai"
    key_field: str  # the field that identifies a line: "id" | "custom_id"
    model: str = ""  # openai: the `model` of every response body

    def encode(self, row: dict[str, Any], endpoint: str | None = None) -> dict[str, Any]:
        """The stored line for a magicdec row; `endpoint` (openai) picks the body's object type."""
        return row if self.name == "magicdec" else openai_line(row, endpoint, self.model)

    def key_of(self, line: dict[str, Any]) -> Any:
        return line[self.key_field]

    def is_error(self, line: dict[str, Any]) -> bool:
        if self.name == "magicdec":
            return line.get("finish_reason") == "error"
        return line.get("error") is not None

    def is_line(self, value: Any) -> bool:
        return isinstance(value, dict) and self.key_field in value


MAGICDEC_LINES = LineFormat("magicdec", "id")


def line_format(name: str, model: str = "") -> LineFormat:
    return MAGICDEC_LINES if name == "magicdec" else LineFormat("openai", "custom_id", model)


def openai_line(row: dict[str, Any], endpoint: str | None, model: str) -> dict[str, Any]:
    """One line of an OpenAI batch output file for a magicdec row."""
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["id"]}
    request_id = f"req_{uuid.uuid4().hex}"
    if row.get("finish_reason") == "error":
        line["response"] = {"status_code": 400, "request_id": request_id, "body": None}
        line["error"] = {"code": ERROR_CODE, "message": row.get("error") or "error"}
        return line
    chat = endpoint == CHAT_URL
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": row["text"]}
    else:
        choice["text"] = row["text"]
    choice.update(logprobs=None, finish_reason=row["finish_reason"])
    prompt, completion = int(row.get("prompt_tokens") or 0), int(row.get("output_tokens") or 0)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    line["error"] = None
    return line


def endpoint_of(openai_request: dict | None, data: dict, chat_template: bool) -> str:
    """The OpenAI endpoint a row answers: for an OpenAI batch request (`openai_request`, from the
    row's columns `data`) its `url`, else chat for messages and completions for a prompt; for a plain
    row, chat when the recipe uses the chat template."""
    if openai_request is not None:
        if data.get("url") in (CHAT_URL, COMPLETIONS_URL):
            return data["url"]
        return CHAT_URL if openai_request.get("messages") is not None else COMPLETIONS_URL
    return CHAT_URL if chat_template else COMPLETIONS_URL
