"""Loading recipes: a YAML path or a shipped recipe name, `--set KEY=VALUE` overrides, validation.

Unknown keys are refused naming the closest valid one; out-of-range values get a one-line `JobError`
naming the file and key. Shipped recipes are package data (`engine/config/recipes/*.yaml`), found
through `importlib.resources`, so they work from an installed wheel. The schema and its defaults are
`engine.config.schema`; this module only reads and checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from engine.config.schema import (DEVICES, DRAFT_METHOD_KEYS, DRAFT_METHODS, DRAFT_SHARED_KEYS, DTYPES,
                                  LINEAR_DTYPES, OUTPUT_ORDERS, POOLINGS, ROW_FORMATS, SAMPLING_KEYS, TRUNCATIONS,
                                  Recipe, SamplingConfig)
from engine.errors import JobError

MAPPING_KEYS = {"input.sampling_columns": SAMPLING_KEYS}  # recipe keys holding a mapping: its allowed keys


def shipped_recipes():
    """The folder of shipped recipes (package data; a real folder for any normal install)."""
    return importlib.resources.files("engine.config") / "recipes"


def shipped_recipe_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in shipped_recipes().iterdir() if p.name.endswith(".yaml"))


def shipped_recipe(name: str):
    """The shipped recipe `name` (e.g. docqa), or None."""
    path = shipped_recipes() / f"{name}.yaml"
    return path if path.is_file() else None


def resolve_recipe_path(recipe: str):
    """A recipe argument is a YAML path or the name of a shipped recipe (`docqa` -> recipes/docqa.yaml)."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise JobError(f"{recipe}: recipe file not found")
        return path
    shipped = shipped_recipe(recipe)
    if shipped is not None:
        return shipped
    names = shipped_recipe_names()
    hint = difflib.get_close_matches(recipe, names, n=1)
    suggestion = f" (did you mean '{hint[0]}'?)" if hint else f" (shipped: {', '.join(names)})"
    raise JobError(f"{recipe}: no such recipe file or shipped recipe{suggestion}")


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
    raw.setdefault("name", path.name.rsplit(".", 1)[0])
    for item in overrides:
        apply_override(raw, item)
    return recipe_from_dict(raw, source=str(path))


def recipe_view(recipe: Recipe, *, all_keys: bool = False) -> dict[str, Any]:
    """The recipe as a dict; unless all_keys, without the draft keys its method does not read (and
    without `spec` for plain decoding). A method this module does not list keeps every key."""
    data = recipe.to_dict()
    method = recipe.draft.method
    if all_keys or method not in DRAFT_METHOD_KEYS:
        return data
    used = ("method",) if method == "none" else DRAFT_SHARED_KEYS + DRAFT_METHOD_KEYS[method]
    data["draft"] = {k: v for k, v in data["draft"].items() if k in used}
    if method == "none":
        data.pop("spec", None)
    return data


class _RecipeDumper(yaml.SafeDumper):
    """YAML as people write recipes: multi-line strings (templates) as `|` block scalars."""


def _represent_str(dumper: yaml.SafeDumper, value: str):
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_str(value)


_RecipeDumper.add_representer(str, _represent_str)


def recipe_yaml(recipe: Recipe, *, all_keys: bool = False) -> str:
    """The resolved recipe as YAML that loads back into the same recipe (`recipe_view` decides the keys)."""
    return yaml.dump(recipe_view(recipe, all_keys=all_keys), Dumper=_RecipeDumper, sort_keys=False,
                     allow_unicode=True, width=100)


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
    parent = ".".join(parts[:-1])
    if parent in MAPPING_KEYS:  # --set input.sampling_columns.temperature=temp
        _check_mapping_key(parent, parts[-1], origin)
    elif ".".join(parts) not in valid_keys():
        raise _unknown_key_error(".".join(parts), origin)


def _check_mapping_key(parent: str, key: Any, origin: str) -> None:
    allowed = MAPPING_KEYS[parent]
    if key not in allowed:
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
        hint = f"; did you mean '{parent}.{close[0]}'?" if close else ""
        raise JobError(f"{origin}: unknown key '{parent}.{key}' (one of {_one_of(allowed)}){hint}")


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
    """Check a value against its annotated type: scalars; tuples of str accept a list or a single
    item; dict[str, str] a mapping whose keys MAPPING_KEYS allows."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
            raise JobError(f"{source}: '{key}' must be a mapping of keys to column names, got {value!r}")
        for name in value:
            _check_mapping_key(key, name, source)
        return dict(value)
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

    if r.dtype not in DTYPES:
        fail("dtype", f"must be {_one_of(DTYPES)}, got {r.dtype!r}")
    if r.device not in DEVICES and not r.device.startswith("cuda:"):
        fail("device", f"must be {_one_of(DEVICES)}, got {r.device!r}")
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
    if d.method in ("pqcache", "guided") and d.sink + d.window >= d.budget:
        fail("draft.budget", f"({d.budget}) must exceed draft.sink + draft.window ({d.sink + d.window})")
    if d.linear_dtype not in LINEAR_DTYPES:
        fail("draft.linear_dtype", f"must be {_one_of(LINEAR_DTYPES)}, got {d.linear_dtype!r}")
    if not 0.0 <= d.smoothing < 1.0:
        fail("draft.smoothing", f"must be in [0, 1), got {d.smoothing!r}")
    if not d.floor >= 0.0:
        fail("draft.floor", f"must be >= 0, got {d.floor!r}")
    if d.reselect_every < 1:
        fail("draft.reselect_every", f"must be >= 1, got {d.reselect_every!r}")
    if d.successors < 0:
        fail("draft.successors", f"must be >= 0, got {d.successors!r}")
    if d.pooling not in POOLINGS:
        fail("draft.pooling", f"must be {_one_of(POOLINGS)}, got {d.pooling!r}")
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
    if b.prefix_block < 1:
        fail("batch.prefix_block", "must be >= 1")
    if b.prefix_reuse and b.prefix_cache < b.prefix_block:
        fail("batch.prefix_cache", f"must hold at least one block (batch.prefix_block = {b.prefix_block} tokens)")
    problem = sampling_problem(r.sampling)
    if problem is not None:
        fail("sampling." + problem[0], problem[1])
    if r.prompt.truncate not in TRUNCATIONS:
        fail("prompt.truncate", f"must be {_one_of(TRUNCATIONS)}, got {r.prompt.truncate!r}")
    if r.output.format not in ROW_FORMATS:
        fail("output.format", f"must be {_one_of(ROW_FORMATS)}, got {r.output.format!r}")
    if r.output.order not in OUTPUT_ORDERS:
        fail("output.order", f"must be {_one_of(OUTPUT_ORDERS)}, got {r.output.order!r}")
    if not r.model:
        fail("model", "must name a model")


def sampling_problem(s: SamplingConfig) -> tuple[str, str] | None:
    """(key, why) for the first out-of-range sampling value, or None: the recipe's and each row's own."""
    if s.temperature < 0:
        return "temperature", "must be >= 0"
    if not 0 < s.top_p <= 1:
        return "top_p", "must be in (0, 1]"
    if s.top_k < 0:
        return "top_k", "must be >= 0"
    if s.max_new_tokens < 1:
        return "max_new_tokens", "must be >= 1"
    if any(not x for x in s.stop):
        return "stop", "must not contain an empty string"
    return None


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]
