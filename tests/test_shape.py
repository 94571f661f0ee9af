"""The shape of src/pulsegate: no import cycle, no module over 550 lines, no class over 300.

Function-local imports and imports under TYPE_CHECKING count: a cycle hidden in a function
is still a cycle. Generated code (the agent's gRPC stubs) is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "pulsegate"
MAX_MODULE_LINES = 550
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        if "proto" in p.relative_to(SRC).parts:
            continue
        name = ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            deps |= {a.name for a in n.names if a.name in mods}
        elif isinstance(n, ast.ImportFrom) and n.module != "__future__":
            parts = pkg.split(".")
            base = parts[: len(parts) - n.level + 1] if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            for a in n.names:
                full = f"{mod}.{a.name}"
                deps.add(full if full in mods else mod)
    return {d for d in deps if d in mods and d != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    """Every module's imports (function-local ones included) form no cycle."""
    mods = _modules()
    graph = {name: _imports(name, p, mods) for name, p in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check itself can fail: a two-module loop is reported."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_module_or_class_too_large() -> None:
    """Modules up to 550 lines, classes up to 300: small units, one concept each."""
    big_modules, big_classes = [], []
    for name, p in _modules().items():
        text = p.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big_modules.append(name)
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, ast.ClassDef):
                length = (n.end_lineno or n.lineno) - n.lineno + 1
                if length > MAX_CLASS_LINES:
                    big_classes.append(f"{name}.{n.name} ({length})")
    assert big_modules == []
    assert big_classes == []
