"""`magicdec plan` for a recipe: the recipe's model, dtype and draft turned into `roofline.plan` inputs.

Reads the model's shapes from its config (no weights), picks the element size from the recipe's
dtype on the device the profile describes (a GPU profile means bf16 unless the recipe says float32;
`measure` means this machine, whose default is float32 on CPU), and returns `plan()`'s dict.
Nothing is run or timed here except `--hardware measure`.
"""

from __future__ import annotations

from engine.config.loading import load_recipe
from engine.models.loading import TORCH_DTYPES, model_shapes
from engine.planning.hardware import hardware_profile
from engine.planning.roofline import plan

def plan_recipe(recipe_arg: str, overrides: tuple[str, ...] = (), *, batch: int, context: int,
                acceptance: float, hardware: str, tp: int = 1, gamma: int | None = None) -> dict:
    recipe = load_recipe(recipe_arg, overrides)
    profile = hardware_profile(hardware)
    on_cpu = hardware.lower() == "measure" and recipe.device in ("auto", "cpu")
    dtype = recipe.dtype if recipe.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    draft = recipe.draft
    result = plan(shapes=model_shapes(recipe.model), hardware=profile, batch=batch, context=context,
                  method=draft.method, budget=draft.budget, acceptance=acceptance, tp=tp,
                  dtype_bytes=TORCH_DTYPES[dtype].itemsize, gamma_max=recipe.spec.gamma_max,
                  draft_shapes=model_shapes(draft.model) if draft.model else None,
                  subspaces=draft.subspaces, bits=draft.bits, gamma=gamma)
    result["recipe"] = recipe.name
    return result
