"""GGUF files, de-quantised once (about 30 s for the default model) into a safetensors copy under the
cache folder, which reloads in about a second. The conversion is announced as a step
(`engine.steps`: a line when it starts, one with its time). This module converts; `registry` decides when.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

from engine.cache_dir import cache_root, file_lock
from engine.errors import JobError
from engine.models.quiet import one_line, quiet_transformers
from engine.steps import step, waiting


def converted_gguf_folder(gguf: Path) -> Path:
    """De-quantise a GGUF once into `<cache>/models/<stem>-<key>` (safetensors), reuse it afterwards."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.with_suffix(".lock"), on_wait=waiting(f"converting {gguf.name} into {folder}")):
        if (folder / "config.json").is_file():  # another process converted it meanwhile
            return folder
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with step(f"converting the model once: {gguf.name} into {folder} (about 30 s for the default model)",
                      f"converted {gguf.name}"):
                _convert_gguf(gguf, tmp)
            os.replace(tmp, folder)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise JobError(f"model: cannot convert {gguf}: {one_line(exc)}") from exc
    return folder


@functools.cache
def _devnull():
    return open(os.devnull, "w")  # noqa: SIM115 - opened once, lives as long as the process


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF loader draws its own progress bar and DeepSpeed (imported on the way) warns about the
    # accelerator: noise for a one-off step. Failures still raise; MAGICDEC_DEBUG=1 shows it all. The
    # sink is never closed: DeepSpeed's logger keeps the stream it was imported under.
    with contextlib.ExitStack() as quiet:
        if os.environ.get("MAGICDEC_DEBUG") != "1":
            quiet.enter_context(contextlib.redirect_stderr(_devnull()))
        quiet.enter_context(quiet_transformers())
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are de-quantised fp32 now; drop the GGUF marker so the copy saves as plain safetensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        model.generation_config.save_pretrained(out)
