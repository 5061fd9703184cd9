"""One request and its progress through the engine: the row's tokens and its own stopping rules.

A `Request` is what the job layer hands the engine (already tokenised, with the row's own sampling
parameters when it has them); a `Sequence` is a request occupying a cache slot; a `Result` is what
comes back. `Sequence.extend` takes the tokens a round produced and keeps only those before the row's
stop (EOS, one of its stop strings, its `max_new_tokens`, the slot's capacity), so a stop inside an
accepted speculative run cuts the row exactly there while other rows go on. No models here; a
sampled row holds its own random generator.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from engine.config.schema import SamplingConfig


@dataclasses.dataclass
class Request:
    index: int  # 0-based position in the input
    id: Any
    prompt_ids: list[int]
    max_new_tokens: int  # the row's own (`sampling.max_new_tokens` when it has a sampling)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # columns the job keeps
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # the job's own data, carried untouched
    enqueued_at: float | None = None  # time.perf_counter() when the job read it (None: not tracked)
    sampling: SamplingConfig | None = None  # the row's sampling parameters; None: the recipe's
    own_seed: bool = False  # the row set its seed: its generator is seeded by that seed alone


@dataclasses.dataclass
class Result:
    request: Request
    token_ids: list[int]
    text: str | None
    finish_reason: str  # stop | length | error
    error: str | None = None
    latency_s: float = 0.0  # admission to finish
    first_token_s: float = 0.0  # admission to first token
    queue_s: float = 0.0  # read from the input (Request.enqueued_at) to admission into a slot

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)


class Sequence:
    def __init__(self, request: Request, slot: int, *, max_len: int, eos_ids: tuple[int, ...],
                 sampling: SamplingConfig, tokenizer: Any, generator: torch.Generator | None):
        """sampling: the row's parameters (its stop strings; its warping, which the rounds read);
        generator: the row's own (None for a greedy row)."""
        self.request = request
        self.slot = slot
        self.prompt_len = len(request.prompt_ids)
        self.max_new_tokens = min(request.max_new_tokens, max_len - self.prompt_len)
        self.eos_ids = set(eos_ids)
        self.sampling = sampling
        self.stop_strings = sampling.stop
        self.tokenizer = tokenizer
        self.generator = generator
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stop_text_end: int | None = None  # where the text is cut when a stop string matched
        self.admitted_at = time.perf_counter()
        self.first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_token(self) -> int:
        """The last emitted token: not yet in the KV cache, it starts the next round."""
        return self.generated[-1]

    @property
    def last_context_token(self) -> int:
        """The token before the pending one (its KV is the last committed position)."""
        return self.generated[-2] if len(self.generated) > 1 else self.request.prompt_ids[-1]

    def extend(self, tokens: list[int]) -> int:
        """Append a round's tokens up to the first stop; returns how many were appended."""
        if self.first_token_at is None and tokens:
            self.first_token_at = time.perf_counter()
        taken = 0
        for token in tokens:
            if self.finished:
                break
            self.generated.append(token)
            taken += 1
            if token in self.eos_ids:
                self.finish_reason = "stop"
            elif self.stop_strings and self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.generated) >= self.max_new_tokens:
                self.finish_reason = "length"
        return taken

    def _hit_stop_string(self) -> bool:
        # Decode a tail long enough to hold the longest stop string plus the newest token's text.
        text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        newest = len(self.tokenizer.decode(self.generated[-1:], skip_special_tokens=True))
        window = max(len(s) for s in self.stop_strings) + newest
        tail_start = max(0, len(text) - window)
        found = [text.find(s, tail_start) for s in self.stop_strings]
        found = [f for f in found if f >= 0]
        if found:
            self.stop_text_end = min(found)
            return True
        return False

    def result(self) -> Result:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
            if self.stop_text_end is not None:
                text = text[: self.stop_text_end]
        now = time.perf_counter()
        first = (self.first_token_at or now) - self.admitted_at
        enqueued = self.request.enqueued_at
        return Result(self.request, list(self.generated), text, self.finish_reason or "length",
                      latency_s=now - self.admitted_at, first_token_s=first,
                      queue_s=self.admitted_at - enqueued if enqueued is not None else 0.0)


def error_result(request: Request, message: str) -> Result:
    return Result(request, [], None, "error", error=message)
