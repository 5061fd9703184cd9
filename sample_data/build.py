"""Build the sample inputs from text already on this machine: the Python standard library's sources.

Nothing third-party is stored in the repository: these files are generated (deterministically) by
`scripts/setup`, or by hand with `python sample_data/build.py [--out DIR]`:

- generic.jsonl  `prompt`                   continue a piece of library documentation
- docqa.jsonl    `document`, `question`     a module's docstrings as a document, a question about it
  docqa.parquet  the same rows as Parquet
- rag.jsonl      `passages` (list), `query` several functions' docstrings, a query about one
- code.jsonl     `code`, `instruction`      a stretch of a module's source and a task about it
- long.jsonl     `prompt`                   16 long source excerpts (~3-4K tokens) for benchmarks
- docqa_shared.jsonl `document`, `question` 8 documents of ~2.5K tokens, 7 questions each, shuffled
                                            (rows sharing their long part: see shared_docs.py)
- needle.jsonl   `prompt`, `answer`, `depth` 16 documents of ~3.5K tokens of docstrings, a passphrase
                                            planted at 10%-90% depth, the question at the end (needle.py)
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from engine.bench.prompts import LONG_MODULES as MODULES  # the same sources `magicdec bench` reads
from engine.bench.prompts import STDLIB, long_texts
from needle import needle_rows
from shared_docs import shared_docqa_rows


def sources() -> list[tuple[str, str]]:
    out = []
    for name in MODULES:
        path = STDLIB / name
        if path.is_file():
            out.append((name, path.read_text(encoding="utf-8")))
    return out


def documented_functions(source: str) -> list[tuple[str, str]]:
    """(name, docstring) of the module's top-level functions and methods that have one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 60:
                found.append((node.name, " ".join(doc.split())))
    return found


def document(name: str, source: str) -> str:
    module_doc = ast.get_docstring(ast.parse(source)) or ""
    parts = [f"Module {name[:-3].replace('/', '.')}", module_doc]
    parts += [f"{fn}: {doc}" for fn, doc in documented_functions(source)]
    return "\n\n".join(p for p in parts if p)


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mods = sources()
    generic, docqa, rag, code, long = [], [], [], [], []
    pool = [(m, fn, doc) for m, src in mods for fn, doc in documented_functions(src)]
    for i, (name, src) in enumerate(mods[:16]):
        fns = documented_functions(src)
        doc = document(name, src)[:6000]
        generic.append({"id": f"g{i}", "prompt": f"{doc[:1500]}\n\nIn summary, this module"})
        if fns:
            fn = fns[len(fns) // 2][0]
            docqa.append({"id": f"d{i}", "document": doc, "question": f"What does `{fn}` do?"})
            picks = [pool[(i * 7 + k * 13) % len(pool)] for k in range(7)] + [(name, *fns[0])]
            picks.sort(key=lambda p: p[1])  # the relevant passage lands anywhere, deterministically
            rag.append({"id": f"r{i}", "passages": [f"{m}:{f}: {d}" for m, f, d in picks],
                        "query": f"What does `{fns[0][0]}` in {name} do?"})
        lines = src.splitlines()
        start = len(lines) // 3
        chunk = "\n".join(lines[start:start + 120])
        task = ["Explain what the following code does.", "List the functions defined below and what each returns.",
                "Suggest one improvement to the following code."][i % 3]
        code.append({"id": f"c{i}", "code": chunk, "instruction": task})
    long = [{"id": f"l{i}", "prompt": text} for i, text in enumerate(long_texts())]
    shared = shared_docqa_rows(mods)
    needle = needle_rows([document(name, src) for name, src in mods])
    for file, rows in [("generic.jsonl", generic), ("docqa.jsonl", docqa), ("rag.jsonl", rag),
                       ("code.jsonl", code), ("long.jsonl", long), ("docqa_shared.jsonl", shared),
                       ("needle.jsonl", needle)]:
        (out / file).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(docqa), out / "docqa.parquet")
    except ImportError:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    build(parser.parse_args().out)
