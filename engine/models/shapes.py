"""Model shapes: layer and head counts read from a config (no weights), parameter counts, and the
random-weight `<name>-shape` models of real shapes (e.g. `llama-3.1-8b-shape`, for timing only).

Used by the memory check, `plan` and `bench` before (or instead of) loading weights. No torch tensors
are created here.
"""

from __future__ import annotations

from typing import Any

from engine.errors import JobError

SHAPE_SUFFIX = "-shape"  # `llama-3.1-8b-shape`: random weights of that shape

# Random-weight models of real shapes (`<name>-shape`): config keys for transformers' LlamaConfig.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
}


def shape_name(spec: str) -> str | None:
    """The built-in shape a `<name>-shape` model spec names, else None."""
    if spec.endswith(SHAPE_SUFFIX) and spec[: -len(SHAPE_SUFFIX)] in MODEL_SHAPES:
        return spec[: -len(SHAPE_SUFFIX)]
    return None


def shape_config(shape: str, **overrides: Any):
    """A LlamaConfig with a real model's shapes (random weights; for timing, not for text)."""
    from transformers import LlamaConfig

    keys = dict(MODEL_SHAPES[shape])
    keys.update(overrides)
    theta = keys.pop("rope_theta", 10000.0)
    keys.setdefault("bos_token_id", 1)
    keys.setdefault("eos_token_id", 2)
    keys.setdefault("pad_token_id", 2)
    return LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": theta}, **keys)


def shapes_for(name: str) -> dict[str, Any]:
    """`model_shapes`-style numbers of a built-in shape (MODEL_SHAPES), without transformers."""
    key = name.removesuffix(SHAPE_SUFFIX)
    if key not in MODEL_SHAPES:
        raise JobError(f"model shapes: unknown '{name}'; built-in: {', '.join(MODEL_SHAPES)}")
    return normalize_shapes(MODEL_SHAPES[key])


def normalize_shapes(shapes: dict[str, Any]) -> dict[str, Any]:
    """Accept `model_shapes()` output or a Hugging Face config mapping (`hidden_size`, ...)."""
    if "hidden" in shapes:
        out = dict(shapes)
    else:
        heads = shapes["num_attention_heads"]
        out = dict(layers=shapes["num_hidden_layers"], hidden=shapes["hidden_size"],
                   intermediate=shapes["intermediate_size"], heads=heads,
                   kv_heads=shapes.get("num_key_value_heads") or heads,
                   head_dim=shapes.get("head_dim") or shapes["hidden_size"] // heads,
                   vocab=shapes["vocab_size"], tied_embeddings=bool(shapes.get("tie_word_embeddings", False)))
    out.setdefault("kv_heads", out["heads"])
    out.setdefault("head_dim", out["hidden"] // out["heads"])
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
        if not isinstance(out.get(key), int) or out[key] < 1:
            raise JobError(f"model shapes: '{key}' must be a positive integer, got {out.get(key)!r}")
    return out


def linear_params(shapes: dict[str, Any]) -> int:
    """Parameters every decode step multiplies by: all linear layers and the lm_head (tied or not)."""
    h, d, q, kv = shapes["hidden"], shapes["head_dim"], shapes["heads"], shapes["kv_heads"]
    attention = h * q * d + 2 * h * kv * d + q * d * h  # q, k, v, o projections
    mlp = 3 * h * shapes["intermediate"]  # gate, up, down
    return shapes["layers"] * (attention + mlp) + h * shapes["vocab"]


def kv_bytes_per_token(shapes: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies across all layers (K and V)."""
    return shapes["layers"] * 2 * shapes["kv_heads"] * shapes["head_dim"] * dtype_bytes


def weight_bytes(shapes: dict, element: int) -> int:
    """Bytes of all the model's weights at `element` bytes each (projections, MLP, embeddings)."""
    per_layer = (shapes["hidden"] * shapes["head_dim"] * (2 * shapes["heads"] + 2 * shapes["kv_heads"])
                 + 3 * shapes["hidden"] * shapes["intermediate"])
    embeddings = shapes["vocab"] * shapes["hidden"] * (1 if shapes["tied_embeddings"] else 2)
    return (shapes["layers"] * per_layer + embeddings) * element
