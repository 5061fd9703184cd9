"""`magicdec plan` for a recipe: the recipe's model, dtype and draft turned into `engine.plan` inputs.

Reads the model's shapes from its config (no weights), picks the element size from the recipe's
dtype on the device the profile describes (a GPU profile means bf16 unless the recipe says float32;
`measure` means this machine, whose default is float32 on CPU), and returns `plan()`'s dict with a
`display` list for the CLI's table. Nothing is run or timed here except `--hardware measure`.
"""

from __future__ import annotations

from engine.config import load_recipe
from engine.models import model_shapes
from engine.plan import display_rows, hardware_profile, plan

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan_recipe(recipe_arg: str, overrides: tuple[str, ...] = (), *, batch: int, context: int,
                acceptance: float, hardware: str, tp: int = 1, gamma: int | None = None) -> dict:
    recipe = load_recipe(recipe_arg, overrides)
    profile = hardware_profile(hardware)
    on_cpu = hardware.lower() == "measure" and recipe.device in ("auto", "cpu")
    dtype = recipe.dtype if recipe.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    draft = recipe.draft
    result = plan(shapes=model_shapes(recipe.model), hardware=profile, batch=batch, context=context,
                  method=draft.method, budget=draft.budget, acceptance=acceptance, tp=tp,
                  dtype_bytes=ELEMENT_BYTES[dtype], gamma_max=recipe.spec.gamma_max,
                  draft_shapes=model_shapes(draft.model) if draft.model else None,
                  subspaces=draft.subspaces, bits=draft.bits, gamma=gamma)
    result["recipe"] = recipe.name
    result["display"] = display_rows(result)
    return result
