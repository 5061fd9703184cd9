"""Recipes: the typed, validated configuration of one job.

A recipe is YAML with the keys of `../shared/docs/contract.md` (every key optional but `model`).
This module turns YAML + `--set KEY=VALUE` overrides into frozen dataclasses, rejecting unknown keys
(naming the closest valid one) and out-of-range values with one-line `JobError`s. It does not load
models or read input; it only describes what the job will do.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.errors import JobError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

DRAFT_METHODS = ("none", "streamingllm", "snapkv", "pqcache")


@dataclass(frozen=True)
class DraftConfig:
    method: str = "streamingllm"  # none | streamingllm | snapkv | pqcache
    model: str | None = None  # None: self-speculation (target weights, compressed KV)
    budget: int = 512  # KV entries the draft reads per sequence, per layer, per KV head
    sink: int = 16  # streamingllm / pqcache: first tokens always kept (attention sinks)
    window: int = 32  # snapkv: observation window; pqcache: recent window always kept
    kernel_size: int = 5  # snapkv: 1-D pooling kernel over the scores
    pooling: str = "avgpool"  # snapkv: avgpool | maxpool
    subspaces: int = 16  # pqcache: sub-vectors per key (must divide head_dim)
    bits: int = 8  # pqcache: log2 of centroids per sub-space
    kmeans_iters: int = 6  # pqcache: Lloyd iterations at prefill
    kmeans_sample: int = 1024  # pqcache: keys sampled per head to fit the centroids
    linear_dtype: str = "auto"  # the draft's GEMMs: auto | same | bfloat16 | float16 | int8 (see engine.draft_gemms)


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
    lookahead: int = 256  # rows read ahead and ordered by prompt length before admission


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings; EOS always stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PromptConfig:
    template: str = "{prompt}"  # Python format fields filled from the row's columns
    chat: bool = False  # wrap the filled template with the model's chat template
    system: str | None = None  # chat only: a system message
    truncate: str = "error"  # a prompt too long for its slot: error | left (drop its start)


@dataclass(frozen=True)
class InputConfig:
    id_field: str = "id"  # rows without it get their 0-based row number as id


@dataclass(frozen=True)
class OutputConfig:
    keep_columns: tuple[str, ...] = ()  # input columns copied into each output row


@dataclass(frozen=True)
class Recipe:
    model: str = "smollm2-135m-instruct"
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


# --------------------------------------------------------------------------------------------
# Loading


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe argument is a YAML path or the name of a shipped recipe (`docqa` -> recipes/docqa.yaml)."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise JobError(f"{recipe}: recipe file not found")
        return path
    shipped = RECIPES_DIR / f"{recipe}.yaml"
    if shipped.is_file():
        return shipped
    names = shipped_recipe_names()
    hint = difflib.get_close_matches(recipe, names, n=1)
    suggestion = f" (did you mean '{hint[0]}'?)" if hint else f" (shipped: {', '.join(names)})"
    raise JobError(f"{recipe}: no such recipe file or shipped recipe{suggestion}")


def shipped_recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe (path or shipped name), apply `KEY=VALUE` overrides, validate."""
    path = resolve_recipe_path(recipe)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"{path}: cannot read recipe: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise JobError(f"{path}:{where} invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{path}: a recipe must be a mapping of keys, got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    for item in overrides:
        apply_override(raw, item)
    return recipe_from_dict(raw, source=str(path))


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `dotted.key=value` (value parsed as a YAML scalar) to a raw recipe mapping."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise JobError(f"--set {item!r}: expected KEY=VALUE, e.g. --set draft.method=snapkv")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    _check_key_path(parts, origin="--set")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def valid_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key a recipe accepts (sections and leaves)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(valid_keys(hints[f.name], name + "."))
    return keys


def _unknown_key_error(key: str, origin: str) -> JobError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return JobError(f"{origin}: unknown recipe key '{key}'{hint}")


def _check_key_path(parts: list[str], origin: str) -> None:
    if ".".join(parts) not in valid_keys():
        raise _unknown_key_error(".".join(parts), origin)


def recipe_from_dict(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    recipe = _build(Recipe, raw, prefix="", source=source)
    _validate(recipe, source)
    return recipe


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{source}: '{prefix.rstrip('.')}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown_key_error(prefix + str(key), source)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], prefix + f.name + ".", source)
        else:
            values[f.name] = _coerce(raw[f.name], hint, prefix + f.name, source)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    """Check a scalar against its annotated type; tuples accept a list or a single item."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if items is None:
            return ()
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
            raise JobError(f"{source}: '{key}' must be a list of strings, got {value!r}")
        return tuple(items)
    allowed = args if origin in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise JobError(f"{source}: '{key}' must not be empty")
    for typ in allowed:
        if typ is bool and isinstance(value, bool):
            return value
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is str and isinstance(value, str):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise JobError(f"{source}: '{key}' must be {names}, got {value!r}")


def _validate(r: Recipe, source: str) -> None:
    def fail(key: str, why: str) -> None:
        raise JobError(f"{source}: '{key}' {why}")

    if r.dtype not in ("auto", "float32", "bfloat16", "float16"):
        fail("dtype", f"must be auto, float32, bfloat16 or float16, got {r.dtype!r}")
    if r.device not in ("auto", "cpu", "cuda") and not r.device.startswith("cuda:"):
        fail("device", f"must be auto, cpu or cuda, got {r.device!r}")
    d = r.draft
    if d.method not in DRAFT_METHODS:
        close = difflib.get_close_matches(d.method, DRAFT_METHODS, n=1)
        fail("draft.method", f"must be one of {', '.join(DRAFT_METHODS)}, got {d.method!r}"
             + (f" (did you mean '{close[0]}'?)" if close else ""))
    if d.budget < 1:
        fail("draft.budget", "must be >= 1")
    if d.sink < 0:
        fail("draft.sink", "must be >= 0")
    if d.window < 1:
        fail("draft.window", "must be >= 1")
    if d.kernel_size < 1 or d.kernel_size % 2 == 0:
        fail("draft.kernel_size", "must be an odd number >= 1")
    if d.method == "streamingllm" and d.sink >= d.budget:
        fail("draft.sink", f"({d.sink}) must be smaller than draft.budget ({d.budget})")
    if d.method == "snapkv" and d.window > d.budget:
        fail("draft.window", f"({d.window}) must not exceed draft.budget ({d.budget})")
    if d.method == "pqcache" and d.sink + d.window >= d.budget:
        fail("draft.budget", f"({d.budget}) must exceed draft.sink + draft.window ({d.sink + d.window})")
    if d.linear_dtype not in ("auto", "same", "bfloat16", "float16", "float32", "int8"):
        fail("draft.linear_dtype", f"must be auto, same, bfloat16, float16, float32 or int8, got {d.linear_dtype!r}")
    if d.pooling not in ("avgpool", "maxpool"):
        fail("draft.pooling", f"must be avgpool or maxpool, got {d.pooling!r}")
    if not 1 <= d.bits <= 12:
        fail("draft.bits", "must be between 1 and 12")
    if d.subspaces < 1 or d.kmeans_iters < 0 or d.kmeans_sample < 1:
        fail("draft.subspaces", "subspaces, kmeans_iters and kmeans_sample must be positive")
    g = r.spec.gamma
    if isinstance(g, str) and g != "auto":
        fail("spec.gamma", f"must be 'auto' or an integer >= 1, got {g!r}")
    if isinstance(g, int) and g < 1:
        fail("spec.gamma", "must be 'auto' or an integer >= 1")
    if r.spec.gamma_max < 1:
        fail("spec.gamma_max", "must be >= 1")
    if r.spec.replan_every < 1:
        fail("spec.replan_every", "must be >= 1")
    b = r.batch
    if b.size < 1:
        fail("batch.size", "must be >= 1")
    if b.max_len is not None and b.max_len < 2:
        fail("batch.max_len", "must be >= 2 (or null for the model's context)")
    if b.prefill_chunk < 1:
        fail("batch.prefill_chunk", "must be >= 1")
    if b.lookahead < 1:
        fail("batch.lookahead", "must be >= 1")
    s = r.sampling
    if s.temperature < 0:
        fail("sampling.temperature", "must be >= 0")
    if not 0 < s.top_p <= 1:
        fail("sampling.top_p", "must be in (0, 1]")
    if s.top_k < 0:
        fail("sampling.top_k", "must be >= 0")
    if s.max_new_tokens < 1:
        fail("sampling.max_new_tokens", "must be >= 1")
    if any(not x for x in s.stop):
        fail("sampling.stop", "must not contain an empty string")
    if r.prompt.truncate not in ("error", "left"):
        fail("prompt.truncate", f"must be error or left, got {r.prompt.truncate!r}")
    if not r.model:
        fail("model", "must name a model")
