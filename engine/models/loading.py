"""Loading a model with transformers for the engine: weights frozen, on the recipe's device and dtype,
with the attention implementation the caller names (the engine registers its own, see
`engine.core.attention`), the EOS ids `generate` would stop on, and the GGUF a model was converted
from (whose blocks the runner may keep for its few-row GEMMs, `engine.models.gguf_blocks`).
`<name>-shape` specs build random weights of a real model's shapes. This module loads; it does not know about KV caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config.schema import DTYPES
from engine.errors import JobError
from engine.models.quiet import one_line, quiet_transformers
from engine.models.registry import resolve_model_folder, source_gguf
from engine.models.shapes import shape_config, shape_name

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}  # recipe name -> torch dtype


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file and the folder of its converted copy (where `engine.models.gguf_blocks` keeps its blocks)."""

    file: Path
    folder: Path


@dataclass
class LoadedModel:
    """A causal LM ready for the engine, with what generation needs to know about it."""

    name: str
    model: torch.nn.Module
    tokenizer: Any | None  # None for random-shape models
    eos_token_ids: tuple[int, ...]
    max_context: int
    device: torch.device
    dtype: torch.dtype
    gguf: GgufSource | None = None  # the GGUF its weights were converted from, if any

    @property
    def config(self):
        return self.model.config


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise JobError(f"device: '{device}' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[dtype]


def load_model(spec: str, *, attn_implementation: str, dtype: str = "auto", device: str = "auto",
               layers: int | None = None) -> LoadedModel:
    """Load a model by recipe name/path; weights stay frozen.

    attn_implementation: a name transformers knows (the engine registers "magicdec" when
    `engine.core.attention` is imported); layers: `<name>-shape` models only, build just that many.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    shape = shape_name(spec)
    if layers is not None and shape is None:
        raise JobError(f"model: only a <name>-shape model can be built with fewer layers, not {spec}")
    if shape is not None:
        config = shape_config(shape, **({"num_hidden_layers": layers} if layers else {}))
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation)
        tokenizer, eos, gguf = None, (config.eos_token_id,), None
    else:
        folder = resolve_model_folder(spec)
        try:
            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(folder)
                model = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch_dtype, attn_implementation=attn_implementation)
        except (OSError, ValueError, KeyError) as exc:
            raise JobError(f"model: cannot load {spec} ({folder}): {one_line(exc)}") from exc
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = model.generation_config
        eos = _eos_ids(generation_config, tokenizer)
        model.to(dev)
        gguf_file = source_gguf(spec)
        gguf = GgufSource(gguf_file, folder) if gguf_file is not None else None
    model.eval().requires_grad_(False)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, eos_token_ids=eos,
                       max_context=max_context, device=dev, dtype=torch_dtype,
                       gguf=gguf)


def _eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """The ids `generate` stops on: the generation config's eos_token_id (int or list), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos]))


def model_shapes(spec: str) -> dict[str, int]:
    """Layer/head/width numbers of a model, read from its config without loading weights."""
    shape = shape_name(spec)
    if shape is not None:
        config = shape_config(shape)
    else:
        from transformers import AutoConfig

        folder = resolve_model_folder(spec)
        config = AutoConfig.from_pretrained(folder)
    heads = config.num_attention_heads
    return dict(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_context=int(getattr(config, "max_position_embeddings", 0) or 4096),
    )


def load_tokenizer(spec: str):
    """Only the tokenizer (for `validate`); None for random-shape models, which have none."""
    if shape_name(spec) is not None:
        return None
    from transformers import AutoTokenizer

    folder = resolve_model_folder(spec)
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise JobError(f"model: cannot load the tokenizer of {spec} ({folder}): {one_line(exc)}") from exc
