"""The package's layout, checked statically: imports go one way (no cycle, lazy imports
included) and no module or function grows past the size a reader can hold.

The import graph is read from the source (AST), so an import inside a function counts as
much as one at the top: a lazy import hides a cycle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import capsense

# the source tree next to these tests when there is one (an installed copy may be older)
_SOURCE = Path(__file__).resolve().parents[3] / "capsense"
ROOT = _SOURCE if _SOURCE.is_dir() else Path(capsense.__file__).resolve().parent
PACKAGE = "capsense"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is (or is inside): ``capsense.a.b.func`` -> ``capsense.a.b``."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its body). ``from pkg import x``
    counts as importing ``pkg.x`` when that is a module, else ``pkg`` itself."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for n in names:
                if n.split(".")[0] != PACKAGE:
                    continue
                target = _resolve(n, modules)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _is_ancestor(pkg: str, mod: str) -> bool:
    return mod.startswith(pkg + ".")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), edges from a package's
    ``__init__`` to its own submodules and from a submodule to its ancestors' ``__init__``
    excluded (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` by construction,
    which is not an import written between two concepts)."""
    edges = {m: {t for t in ts if not _is_ancestor(m, t) and not _is_ancestor(t, m)} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_graph_reader_sees_lazy_imports_and_cycles():
    """The checker itself: a cycle closed by an import inside a function is found."""
    graph = {"capsense.a": {"capsense.b"}, "capsense.b": {"capsense.c"}, "capsense.c": {"capsense.a"}, "capsense.d": set()}
    assert find_cycles(graph) == [["capsense.a", "capsense.b", "capsense.c"]]
    real = import_graph()
    # commands import the library only inside their functions: the reader must see those edges
    assert "capsense.compress.request" in real["capsense.commands.compress"]


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_module_and_function_sizes():
    too_long = []
    for mod, path in _modules().items():
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            too_long.append(f"module {mod}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"function {mod}.{node.name}: {length} lines")
    assert too_long == [], "\n".join(too_long)
