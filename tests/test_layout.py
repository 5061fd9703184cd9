"""The package's shape is its architecture: import rules between the layers, no cycles, small modules,
one home for each constant, and a docstring on every package saying what it is and is not.

Read from the source (AST), so a rule broken anywhere, at module level or inside a function, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "magicdec_cli")
MAX_LINES = 420  # "no module over ~400 lines"

# layer -> the layers it must not import (prefixes of dotted module names)
FORBIDDEN = {
    "engine.config": ("engine.core", "engine.spec", "engine.job", "engine.scale", "engine.bench", "engine.planning",
                      "engine.models"),
    "engine.models": ("engine.core", "engine.spec", "engine.job", "engine.scale", "engine.bench", "engine.planning"),
    "engine.core": ("engine.spec", "engine.job", "engine.scale", "engine.bench", "engine.planning"),
    "engine.spec": ("engine.job", "engine.scale", "engine.bench", "engine.planning"),
    "engine.planning": ("engine.job", "engine.scale", "engine.bench", "engine.core"),
    "engine.job": ("engine.scale", "engine.bench"),
    "engine.scale": ("engine.bench",),
    "engine.bench": ("engine.job", "engine.scale"),
    "engine": ("magicdec_cli",),  # nothing under engine/ imports the CLI
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """Every magicdec module `name` imports (anywhere in the file), resolved to module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `engine.core.kernels.load` -> engine.core.kernels
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def test_the_layers_import_downward_only():
    broken = []
    for name, targets in GRAPH.items():
        for layer, forbidden in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                broken += [f"{name} imports {t}" for t in targets
                           if any(t == f or t.startswith(f + ".") for f in forbidden)]
    assert not broken, "\n".join(broken)


def test_no_import_cycles():
    """Between modules (any import, even inside a function) and between the layers."""
    def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
        state: dict[str, int] = {}
        stack: list[str] = []

        def visit(node: str) -> list[str] | None:
            state[node] = 1
            stack.append(node)
            for nxt in sorted(graph.get(node, ())):
                if state.get(nxt) == 1:
                    return stack[stack.index(nxt):] + [nxt]
                if nxt not in state and (found := visit(nxt)):
                    return found
            stack.pop()
            state[node] = 2
            return None

        for node in sorted(graph):
            if node not in state and (found := visit(node)):
                return found
        return None

    # `engine` (the package docstring) imports nothing; each module's parent packages are not edges.
    module_cycle = cycle_in({n: {t for t in ts if not n.startswith(t + ".")} for n, ts in GRAPH.items()})
    assert module_cycle is None, " -> ".join(module_cycle)

    def layer(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]

    layers: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        layers.setdefault(layer(name), set()).update(layer(t) for t in targets if layer(t) != layer(name))
    layer_cycle = cycle_in(layers)
    assert layer_cycle is None, " -> ".join(layer_cycle)


def test_the_rules_see_real_imports():
    """The walk above must not pass by seeing nothing: known edges are found."""
    assert "engine.core.attention" in GRAPH["engine.core.runner"]
    assert "engine.core.kernels" in GRAPH["engine.core.attention"]  # `from engine.core import kernels as ...`
    assert "engine.spec.decoder" in GRAPH["engine.job.run"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_small_and_say_what_they_are(name):
    path = MODULES[name]
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (split it: ~400 at most)"
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring and len(docstring) > 40, f"{path.relative_to(ROOT)} needs a docstring saying what it is"


def test_every_constant_has_one_home():
    """The default model's name, the draft methods and the dtypes are spelled out once, in engine.config."""
    spellings = {'"smollm2-135m-instruct"': 1, '"streamingllm", "snapkv", "pqcache"': 1,
                 '"float32", "bfloat16", "float16"': 1}
    for text, allowed in spellings.items():
        homes = [str(p.relative_to(ROOT)) for p in MODULES.values() if text in p.read_text(encoding="utf-8")]
        assert len(homes) == allowed and homes[0].startswith("engine/config/"), f"{text} is spelled in {homes}"
