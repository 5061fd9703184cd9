"""One row's sampling parameters: the recipe's, with the values the row sets for itself put in.

An OpenAI batch row sets them in its body (`temperature`, `top_p`, `top_k`, `seed`, `max_tokens` /
`max_completion_tokens`, `stop`; read and checked by `engine.job.io.openai_batch`); a plain row in
the columns `input.sampling_columns` names (e.g. `{temperature: temp}`). A null or absent value
falls back to the recipe's. A value of the wrong type or out of range is a `RowError` naming the
body field or column, so the row becomes an error record (and `validate` lists it). This module
neither tokenises nor runs anything; it is called from `engine.job.requests` only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config.loading import sampling_problem
from engine.config.schema import Recipe, SamplingConfig
from engine.errors import RowError
from engine.job.io.common import kind

_INTEGER_KEYS = ("top_k", "seed", "max_new_tokens")
_NUMBER_KEYS = ("temperature", "top_p")


@dataclasses.dataclass(frozen=True)
class RowSampling:
    params: SamplingConfig  # the recipe's sampling with the row's own values
    own_seed: bool  # the row set its seed: its generator is seeded by that seed alone


def row_sampling(recipe: Recipe, data: dict, openai: dict | None) -> RowSampling:
    """The sampling of one row (`openai`: its normalised OpenAI batch request, or None)."""
    if openai is not None:
        overrides = dict(openai["overrides"])
        origins = {name: f"body.{_BODY_NAMES.get(name, name)}" for name in overrides}
    else:
        overrides, origins = _column_values(data, recipe.input.sampling_columns)
    if not overrides:
        return RowSampling(recipe.sampling, False)
    if "stop" in overrides:
        overrides["stop"] = tuple(overrides["stop"])
    params = dataclasses.replace(recipe.sampling, **overrides)
    problem = sampling_problem(params)
    if problem is not None:
        key, why = problem
        raise RowError(f"{origins[key]} {why}, got {getattr(params, key)!r}")
    return RowSampling(params, "seed" in overrides)


_BODY_NAMES = {"max_new_tokens": "max_tokens"}  # how an OpenAI body spells a recipe key


def _column_values(data: dict, columns: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values, origins = {}, {}
    for key, column in columns.items():
        value = data.get(column)
        if value is None or (isinstance(value, float) and math.isnan(value)):  # null (pandas: NaN)
            continue
        origin = f"column '{column}' (sampling.{key})"
        values[key], origins[key] = _typed(key, value, origin), origin
    return values, origins


def _typed(key: str, value: Any, origin: str) -> Any:
    if key == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise RowError(f"{origin} must be a string or a list of strings, got {kind(value)}")
        return list(items)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        wanted = "an integer" if key in _INTEGER_KEYS else "a number"
        raise RowError(f"{origin} must be {wanted}, got {value!r}")
    if key in _NUMBER_KEYS:
        return float(value)
    if isinstance(value, float) and not value.is_integer():  # 5.0 from a float column is fine
        raise RowError(f"{origin} must be an integer, got {value!r}")
    return int(value)
