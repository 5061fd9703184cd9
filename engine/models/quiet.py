"""Keeping the libraries magicdec loads models with quiet: transformers' progress bars and advisory
warnings off, and whatever they print kept off stdout (`--json` owns it). Nothing else."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and advisory warnings while loading, and keep whatever the
    libraries it pulls in print off stdout. Loading a GGUF imports DeepSpeed through transformers'
    integrations, and DeepSpeed's logger binds to the stdout of its import time."""
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


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
