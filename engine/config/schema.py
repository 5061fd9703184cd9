"""Recipes: the typed configuration of one job, the one list of allowed values, and what derives from it.

A recipe is YAML with the keys of `../shared/docs/contract.md` (every key optional but `model`); these
frozen dataclasses are its schema and defaults. `engine.config.loading` turns YAML + `--set` overrides
into them and validates the values against the tuples below. The capacity arithmetic a recipe implies
(`slot_capacity`, `round_scratch`) lives here too, so that checking a job (memory, validation) never
needs the engine. Nothing here reads files, loads models or knows about torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"  # the packaged default (engine.models.registry knows where it lives)
DRAFT_METHODS = ("none", "streamingllm", "snapkv", "pqcache", "guided")  # draft.method; engine.spec.compressors has one per method but none
DTYPES = ("auto", "float32", "bfloat16", "float16")  # dtype
DEVICES = ("auto", "cpu", "cuda")  # device (also cuda:N)
LINEAR_DTYPES = ("auto", "same", "bfloat16", "float16", "float32", "int8")  # draft.linear_dtype
POOLINGS = ("avgpool", "maxpool")  # draft.pooling
TRUNCATIONS = ("error", "left")  # prompt.truncate
ROW_FORMATS = ("auto", "magicdec", "openai")  # output.format (auto: openai for an OpenAI batch input)
OUTPUT_ORDERS = ("input", "finish")  # output.order

# The draft keys each method reads (`magicdec recipes NAME` shows only these; --all shows every key).
DRAFT_SHARED_KEYS = ("method", "model", "budget", "linear_dtype")  # every method but none
DRAFT_METHOD_KEYS = {"none": (), "streamingllm": ("sink",), "snapkv": ("window", "kernel_size", "pooling"),
                     "pqcache": ("sink", "window", "subspaces", "bits", "kmeans_iters", "kmeans_sample"),
                     "guided": ("sink", "window", "kernel_size", "pooling", "smoothing", "floor", "reselect_every",
                                "successors")}

# The sampling keys a row may set for itself (OpenAI batch body fields, or `input.sampling_columns`).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop")


@dataclass(frozen=True)
class DraftConfig:
    method: str = "streamingllm"  # none | streamingllm | snapkv | pqcache | guided
    model: str | None = None  # None: self-speculation (target weights, compressed KV)
    budget: int = 512  # KV entries the draft reads per sequence, per layer, per KV head
    sink: int = 16  # streamingllm / pqcache / guided: first tokens always kept (attention sinks)
    window: int = 32  # snapkv: observation window; pqcache / guided: recent window always kept (guided: also its prefill observation window)
    kernel_size: int = 5  # snapkv / guided (at prefill): 1-D pooling kernel over the scores
    pooling: str = "avgpool"  # snapkv / guided (at prefill): avgpool | maxpool
    smoothing: float = 0.0  # guided: weight of the previous round's scores, score = s * previous + (1 - s) * this round's
    floor: float = 1.0  # guided: positions scoring under floor x the uniform share (1 / positions) are ranked by recency
    reselect_every: int = 1  # guided: speculative rounds per re-selection (1: after every round's verification)
    successors: int = 4  # guided: after a round, a position ranks by the highest score of itself and the `successors` before it
    subspaces: int = 16  # pqcache: sub-vectors per key (must divide head_dim)
    bits: int = 8  # pqcache: log2 of centroids per sub-space
    kmeans_iters: int = 6  # pqcache: Lloyd iterations at prefill
    kmeans_sample: int = 1024  # pqcache: keys sampled per head to fit the centroids
    linear_dtype: str = "auto"  # the draft's GEMMs: auto | same | bfloat16 | float16 | int8 (see engine.spec.draft.gemms)


@dataclass(frozen=True)
class SpecConfig:
    gamma: int | str = "auto"  # "auto" (measured cost model) or a fixed int >= 1
    gamma_max: int = 8  # the largest gamma "auto" considers
    replan_every: int = 16  # rounds between two re-evaluations of the auto gamma


@dataclass(frozen=True)
class BatchConfig:
    size: int = 16  # concurrent sequences (KV-cache slots)
    max_len: int | None = None  # prompt + output tokens per slot; None = the model's context
    prefill_chunk: int = 512  # prompt tokens per prefill forward
    lookahead: int = 256  # rows read ahead and ordered (shared prefixes together, else longest first)
    prefix_reuse: bool = True  # reuse the K/V of a prompt prefix shared with earlier rows
    prefix_cache: int = 32768  # tokens of prefix K/V kept for reuse (per model; LRU beyond it)
    prefix_block: int = 32  # tokens per matched block (BENCHMARKS.md section 29: 32 against 64 and 16)


@dataclass(frozen=True)
class SamplingConfig:
    """The recipe's sampling, and (with a row's own values put in) one row's: see engine.job.row_sampling."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings; EOS always stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def warping(self) -> tuple[float, float, int] | None:
        """What turns logits into a distribution (None: greedy); rows with equal warping sample together."""
        return None if self.greedy else (self.temperature, self.top_p, self.top_k)


@dataclass(frozen=True)
class PromptConfig:
    template: str = "{prompt}"  # Python format fields filled from the row's columns
    chat: bool = False  # wrap the filled template with the model's chat template
    system: str | None = None  # chat only: a system message
    truncate: str = "error"  # a prompt too long for its slot: error | left (drop its start)


@dataclass(frozen=True)
class InputConfig:
    id_field: str = "id"  # rows without it get their 0-based row number as id
    # sampling key (SAMPLING_KEYS) -> the column holding a row's own value; a null or absent value
    # falls back to the recipe's sampling (e.g. {temperature: temp, stop: stops})
    sampling_columns: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputConfig:
    keep_columns: tuple[str, ...] = ()  # input columns copied into each output row (magicdec rows)
    format: str = "auto"  # auto | magicdec | openai (the OpenAI batch output format; JSONL only)
    order: str = "input"  # input: rows in input order once the job completes | finish: as rows finish


@dataclass(frozen=True)
class Recipe:
    model: str = DEFAULT_MODEL
    name: str = "recipe"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    draft: DraftConfig = field(default_factory=DraftConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def round_scratch(recipe: Recipe) -> int:
    """Positions one round may write past a row's committed length: gamma_max + 1 (0 without a draft)."""
    if recipe.draft.method == "none":
        return 0
    gamma = recipe.spec.gamma
    return (gamma if isinstance(gamma, int) else recipe.spec.gamma_max) + 1


def slot_capacity(recipe: Recipe, max_context: int) -> tuple[int, int]:
    """(max_len, physical capacity): max_len tokens per row, plus scratch for one round's drafts."""
    max_len = recipe.batch.max_len or max_context
    return max_len, max_len + max(round_scratch(recipe), 1)
