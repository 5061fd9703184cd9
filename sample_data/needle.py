"""The needle-in-a-haystack set: a fact ("The secret passphrase is <word>-<word>-<number>.") planted at
a depth of 10% to 90% of a long document made of the Python standard library's docstrings, the
question at the end. The document is ~3.6K tokens, a little more than the `--context 3328` it is
benchmarked at; the depth is that within the prompt's last ~3328 tokens, placed by characters
counted from the end (so the fact survives the cut): the `depth` column is the intended depth
(0.15-0.88), SmolLM2's tokenizer puts the fact at 0.11-0.87 of the 3328 tokens kept.

What it is for: `magicdec bench --prompts sample_data/needle.jsonl --context 3328 ...` (rows marked
`"tail": true` are each one prompt, their last `--context` tokens, so the question survives) times
drafts whose view must find one fact far from the newest tokens; `magicdec run generic --input
sample_data/needle.jsonl` answers them (the `answer` column is the passphrase). Deterministic: the same Python
version writes the same rows. Written by `sample_data/build.py`; it reads nothing but the sources it
is given.
"""

from __future__ import annotations

import random

DOC_CHARS = 13000  # ~3.6K tokens of docstring prose (SmolLM2's tokenizer), more than the context
WINDOW_CHARS = 11800  # ~3328 tokens of it (3.55 characters a token): the prompt bench keeps
ROWS = 16
FIRST_DEPTH, LAST_DEPTH = 0.15, 0.88  # measured in tokens: ~10%-90%
QUESTION = ("\n\nQuestion: What is the secret passphrase mentioned in the document above?\n"
            "Answer: The secret passphrase is")


def haystack(paragraphs: list[str], rng: random.Random, chars: int) -> list[str]:
    """Paragraphs drawn without replacement in `rng`'s order (mixing modules, so every row's text is
    about as dense in tokens), up to `chars` characters."""
    out, size = [], 0
    for paragraph in rng.sample(paragraphs, len(paragraphs)):
        if size + len(paragraph) + 2 <= chars:
            out.append(paragraph)
            size += len(paragraph) + 2
    return out


def passphrase(rng: random.Random, words: list[str]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}-{rng.randint(10, 99)}"


def needle_rows(documents: list[str]) -> list[dict]:
    """ROWS rows {id, prompt, answer, depth, tail}; documents: module documents (docstrings joined)."""
    paragraphs = [p for doc in documents for p in doc.split("\n\n") if len(p) >= 40]
    vocabulary = sorted({w.lower() for doc in documents for w in doc.split() if w.isalpha() and 5 <= len(w) <= 8})
    rows = []
    for i in range(ROWS):
        rng = random.Random(1000 + i)
        depth = FIRST_DEPTH + (LAST_DEPTH - FIRST_DEPTH) * i / (ROWS - 1)
        answer = passphrase(rng, vocabulary)
        chosen = haystack(paragraphs, rng, DOC_CHARS)
        # The sentence boundary nearest the depth of the prompt's last WINDOW_CHARS characters (the
        # part a 3328-token context keeps), counted from the end so that it survives the cut.
        text = "\n\n".join(chosen)
        want = len(text) - (1 - depth) * WINDOW_CHARS
        at = min((i + 2 for i in range(len(text) - 1) if text[i:i + 2] in (". ", "\n\n")),
                 key=lambda i: abs(i - want))
        fact = f"The secret passphrase is {answer}. Remember it. "
        rows.append({"id": f"n{i}", "prompt": text[:at] + fact + text[at:] + QUESTION, "answer": answer,
                     "depth": round(depth, 3), "tail": True})
    return rows
