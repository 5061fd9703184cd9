"""The prompts `magicdec bench` times by default: long stretches of real source code, made on the spot
from the Python standard library's own files (present wherever Python is), so an installed wheel
needs no data files and nothing third-party is stored. `sample_data/build.py` writes the same texts
as `sample_data/long.jsonl`. Random-weight (`-shape`) models, which have no tokenizer, get token ids.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from engine.errors import JobError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LONG_MODULES = ["textwrap.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py", "shlex.py", "string.py",
                "json/decoder.py", "json/encoder.py", "csv.py", "difflib.py", "fnmatch.py", "glob.py",
                "calendar.py", "colorsys.py", "pprint.py", "random.py", "base64.py", "quopri.py", "ipaddress.py"]
LONG_CHARS = 13000  # ~3-4K tokens of source per text
LONG_COUNT = 16


def long_texts(count: int = LONG_COUNT) -> list[str]:
    """`count` long source excerpts, each ending in a request to summarise it."""
    sources = [(STDLIB / name).read_text(encoding="utf-8") for name in LONG_MODULES if (STDLIB / name).is_file()]
    if not sources:
        raise JobError(f"bench: no standard-library sources under {STDLIB} to make prompts from; give --prompts")
    texts = []
    for i, src in enumerate((sources * (1 + count // len(sources)))[:count]):
        offset = (i * 3001) % max(1, len(src) - LONG_CHARS - 1000)
        texts.append(src[offset:offset + LONG_CHARS] + "\n\n# Summary of the code above:\n")
    return texts


def bench_prompts(tokenizer, count: int, length: int, *, path: str | None = None,
                  vocab: int = 0) -> tuple[list[list[int]], bool]:
    """`count` prompts of exactly `length` tokens, and whether they are tails (see below).

    With a tokenizer: windows at different offsets of the concatenated texts (`path`'s `prompt`
    column, or `long_texts()`), so rows differ. If every row of `path` says `"tail": true` (the
    needle set: a question at the end of each prompt), row i is instead text i's (cycled) last
    `length` tokens, and a shorter context keeps each prompt's end (returned True). Without a
    tokenizer: one random prefix shared by every row, each row's last token its own (timing only:
    random weights accept nothing meaningful, and a shared prefix is prefilled once).
    """
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(3, vocab, (length - 1,), generator=g).tolist()
        return [prefix + [3 + i % (vocab - 3)] for i in range(count)], False
    if path is not None:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        texts = [row["prompt"] for row in rows]
        if rows and all(row.get("tail") is True for row in rows):
            ids = [tokenizer(text)["input_ids"] for text in texts]
            short = [i for i, row in enumerate(ids) if len(row) < length]
            if short:
                raise JobError(f"bench prompts: {path} row {short[0] + 1} has {len(ids[short[0]])} tokens, "
                               f"{length} needed for --context {length}")
            return [ids[i % len(ids)][-length:] for i in range(count)], True
    else:
        texts = long_texts()
    stream = [t for text in texts for t in tokenizer(text)["input_ids"]]
    if len(stream) < length:
        raise JobError(f"bench prompts: {len(stream)} tokens of text, {length} needed for --context {length}")
    step = max(1, (len(stream) - length) // max(1, count - 1))
    return [stream[i * step: i * step + length] for i in range(count)], False
