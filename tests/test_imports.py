"""The flint/*.py modules import each other without a cycle.

Every import statement counts, at module level or inside a function: ``from flint import x``,
``from . import x``, ``from .x import y``, ``from flint.x import y``, ``import flint.x``. An edge
goes to a top-level module of the package (flint/x.py); imports of subpackages (flint.kernels)
and dynamic ``importlib.import_module`` calls are not edges. CPU only, no flint import.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "flint"


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PKG.glob("*.py"))}


def _targets(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The flint top-level modules one import statement names ("__init__" for the package)."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "flint":
                out.append(parts[1] if len(parts) > 1 else "__init__")
    elif isinstance(node, ast.ImportFrom):
        if node.level > 1:
            return out  # above the package
        if node.level == 1:
            parts = node.module.split(".") if node.module else []
        elif node.module and node.module.split(".")[0] == "flint":
            parts = node.module.split(".")[1:]
        else:
            return out
        if parts:
            out.append(parts[0])
        else:  # from flint import x / from . import x: x is a module or a name of __init__
            for a in node.names:
                if a.name in modules:
                    out.append(a.name)
                elif not (PKG / a.name).is_dir():  # a subpackage is not an edge
                    out.append("__init__")
    return [t for t in out if t in modules]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line of such an import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, modules):
                    if t != name:
                        edges[t] = min(edges.get(t, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The cycles a depth-first search closes (first == last), one per back edge; [] iff acyclic."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w)
        path.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v)
    return cycles


def _describe(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} (flint/{a}.py:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_graph_sees_the_import_forms():
    mods = {m: Path() for m in ("a", "b", "c", "d", "e", "__init__")}
    src = ("from flint import a\nfrom . import b, VERSION\nfrom .c import x\nimport flint.d\n"
           "def f():\n    from flint.e import y\n    import os\n    from .kernels.build import build\n")
    got = [t for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))
           for t in _targets(n, mods)]
    assert sorted(got) == ["__init__", "a", "b", "c", "d", "e"]
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycles(g) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 10, sorted(graph)
    cycles = find_cycles(graph)
    msg = "\n".join(_describe(c, graph) for c in cycles)
    if cycles:
        print("import cycles among flint/*.py:\n" + msg)
    assert not cycles, "import cycles among flint/*.py:\n" + msg
