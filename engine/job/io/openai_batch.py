"""Rows in the OpenAI batch format (what vLLM's `run-batch` reads): recognised, checked, normalised.

A row with `custom_id` and `body` is a request: `body.prompt` (`/v1/completions`) or `body.messages`
(`/v1/chat/completions`), plus the sampling fields it sets. Anything magicdec cannot run is a
`RowError` naming the field. This module neither tokenises nor writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.errors import RowError
from engine.job.io.common import kind

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def openai_batch_request(data: dict) -> dict | None:
    """Normalise a row in the OpenAI batch format (vLLM `run-batch`); None if it is not one.

    Returns {"id", "prompt" (str | None), "messages" (list | None), "overrides"}, overrides holding
    only the sampling keys the body sets, under recipe names (max_tokens -> max_new_tokens).
    Raises `RowError` when the row has `custom_id` and `body` but is not a request magicdec can run.
    """
    if not isinstance(data, dict) or "custom_id" not in data or "body" not in data:
        return None
    custom_id, body, url = data["custom_id"], data["body"], data.get("url")
    if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
        raise RowError(f"custom_id must be a string, got {kind(custom_id)}")
    if data.get("method", "POST") != "POST":
        raise RowError(f"method must be POST, got {data['method']!r}")
    if url not in (None, COMPLETIONS_URL, CHAT_URL):
        raise RowError(f"url {url!r} is not supported (only {COMPLETIONS_URL} and {CHAT_URL})")
    if not isinstance(body, dict):
        raise RowError(f"body must be an object, got {kind(body)}")
    if "prompt" in body and "messages" in body:
        raise RowError("body has both prompt and messages")
    if "prompt" not in body and "messages" not in body:
        raise RowError("body has neither prompt nor messages")
    wanted = "messages" if url == CHAT_URL else "prompt" if url == COMPLETIONS_URL else None
    if wanted is not None and wanted not in body:
        raise RowError(f"body for {url} needs {wanted}")
    prompt = _batch_prompt(body["prompt"]) if "prompt" in body else None
    messages = _batch_messages(body["messages"]) if "messages" in body else None
    return {"id": custom_id, "prompt": prompt, "messages": messages,
            "overrides": _batch_overrides(body)}


def looks_like_openai_batch(data: dict | None) -> bool:
    """Whether a row is meant as an OpenAI batch request (it may still be one magicdec cannot run)."""
    return isinstance(data, dict) and "custom_id" in data and "body" in data


_SALVAGE_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*"|-?[0-9]+)')


def salvage_custom_id(raw: bytes | None) -> str | int | None:
    """The `custom_id` of a line that is not valid JSON, when it can still be read from its text."""
    match = _SALVAGE_ID.search(raw) if raw else None
    if match is None:
        return None
    try:
        value = json.loads(match.group(1).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, (str, int)) else None


def _batch_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise RowError("prompt as token ids is not supported; give the text")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise RowError(f"a list of {len(prompt)} prompts is not supported; one prompt per row")
    if not isinstance(prompt, str):
        raise RowError(f"prompt must be a string, got {kind(prompt)}")
    return prompt


def _batch_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"messages[{i}] must be an object with a string role and content")
        out.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    return out


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(f"messages[{i}].content must be a string or a list of text parts, "
                       f"got {kind(content)}")
    texts = []
    for part in content:
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type != "text" or not isinstance(part.get("text"), str):
            raise RowError(f"messages[{i}].content: part of type {part_type!r} is not supported "
                           "(text only)")
        texts.append(part["text"])
    return "\n".join(texts)


# body key -> (recipe key, integer?, lowest, highest); the first body key present wins a recipe key
_BATCH_SAMPLING = {"max_completion_tokens": ("max_new_tokens", True, 1, None),
                   "max_tokens": ("max_new_tokens", True, 1, None),
                   "temperature": ("temperature", False, 0, None),
                   "top_p": ("top_p", False, 0, 1),
                   "top_k": ("top_k", True, -1, None),  # vLLM: -1 = off, like our 0
                   "seed": ("seed", True, None, None)}


def _batch_overrides(body: dict) -> dict[str, Any]:
    if body.get("n", 1) not in (1, None):
        raise RowError("body.n must be 1: one completion per row")
    out: dict[str, Any] = {}
    for key, (name, integer, low, high) in _BATCH_SAMPLING.items():
        value = body.get(key)
        if value is None or name in out:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise RowError(f"body.{key} must be {'an integer' if integer else 'a number'}, "
                           f"got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise RowError(f"body.{key} must be {bounds}, got {value!r}")
        out[name] = value if integer else float(value)
    if out.get("top_p") == 0:
        raise RowError("body.top_p must be > 0")
    if "top_k" in out:
        out["top_k"] = max(0, out["top_k"])
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RowError("body.stop must be a string or a list of strings")
        out["stop"] = stop
    return out
