"""The docQA set whose rows share their long part: several documents of 2-3K tokens (stretches of the
Python standard library's source), each asked 7 different questions about the functions it defines,
rows shuffled (not grouped by document). What prefix reuse is for: run with the `docqa` recipe,
`magicdec run docqa --input sample_data/docqa_shared.jsonl`. Written by `sample_data/build.py`."""

from __future__ import annotations

import ast
import random

DOC_CHARS = 9000  # ~2.5K tokens of source code
QUESTIONS_PER_DOC = 7
DOCUMENTS = 8
TEMPLATES = ["What does `{}` do?", "What arguments does `{}` take?", "What does `{}` return?",
             "When would you call `{}`?", "Is `{}` a function or a class, and what is it for?",
             "Which other names defined here does `{}` use?", "Give a one-line summary of `{}`."]


def excerpt(source: str, chars: int) -> str:
    """Whole lines from the start of the first top-level definition, up to `chars` characters."""
    lines = source.splitlines()
    first = next((node.lineno - 1 for node in ast.parse(source).body
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef))), 0)
    out, size = [], 0
    for line in lines[first:]:
        if size + len(line) + 1 > chars:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def defined_names(text: str) -> list[str]:
    """Functions and classes defined (def / class lines) in a stretch of source, in order."""
    names = []
    for line in text.splitlines():
        stripped = line.strip()
        for keyword in ("def ", "class "):
            if stripped.startswith(keyword):
                name = stripped[len(keyword):].split("(")[0].split(":")[0].strip()
                if name and not name.startswith("_") and name not in names:
                    names.append(name)
    return names


def shared_docqa_rows(sources: list[tuple[str, str]], seed: int = 0) -> list[dict]:
    """DOCUMENTS x QUESTIONS_PER_DOC rows `{id, document, question}`, shuffled deterministically."""
    rows = []
    for name, src in sources:
        if len(rows) >= DOCUMENTS * QUESTIONS_PER_DOC:
            break
        text = excerpt(src, DOC_CHARS)
        names = defined_names(text)
        if len(text) < DOC_CHARS // 2 or len(names) < QUESTIONS_PER_DOC:
            continue
        doc_id = name[:-3].replace("/", ".")
        document = f"Source of the Python module {doc_id}:\n\n{text}"
        for q, fn in enumerate(names[:QUESTIONS_PER_DOC]):
            rows.append({"id": f"{doc_id}-q{q}", "document": document, "question": TEMPLATES[q].format(fn)})
    random.Random(seed).shuffle(rows)
    return rows
