"""The flint/*.py modules and those of its wings (flint/server/, flint/speculative/, flint/quant/) import each
other without a cycle.

Every import statement counts, at module level or inside a function: ``from flint import x``,
``from . import x``, ``from .x import y``, ``from ..x import y`` (in a wing), ``from flint.x import y``,
``import flint.x``. An edge goes to a module of the package (flint/x.py, or a wing's flint/server/x.py, named
``server.x``; ``server.__init__`` for that package's __init__.py); imports of other subpackages
(flint.kernels) and dynamic ``importlib.import_module`` calls are not edges. CPU only, no flint import.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "flint"
WINGS = ("server", "speculative", "quant")  # subpackages whose modules are nodes of the graph like flint/*.py's


def _modules() -> dict[str, Path]:
    mods = {p.stem: p for p in sorted(PKG.glob("*.py"))}
    for wing in WINGS:
        mods.update({f"{wing}.{p.stem}": p for p in sorted((PKG / wing).glob("*.py"))})
    return mods


def _resolve(parts: list[str], modules: dict[str, Path]) -> str | None:
    """The module that flint.<parts> is or lies in (a package's __init__), None outside the graph."""
    if not parts:
        return "__init__"
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name
        if f"{name}.__init__" in modules:
            return f"{name}.__init__"
    return None


def _targets(node: ast.AST, modules: dict[str, Path], pkg: str = "") -> list[str]:
    """The flint modules one import statement names ("__init__" for the package), from a module of
    package flint.<pkg> (pkg "" for flint itself)."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "flint":
                out.append(_resolve(parts[1:], modules))
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            here = pkg.split(".") if pkg else []
            if node.level - 1 > len(here):
                return out  # above the package
            base = here[:len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == "flint":
            base = node.module.split(".")[1:]
        else:
            return out
        for a in node.names:  # from X import m: m is a module of X, a subpackage or a name of X's module
            name = ".".join(base + [a.name])
            if name in modules:
                out.append(name)
            elif PKG.joinpath(*base, a.name).is_dir():  # a subpackage: its __init__ if it is a node
                out.append(f"{name}.__init__")
            else:
                out.append(_resolve(base, modules))
    return [t for t in out if t in modules]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line of such an import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        pkg = name.rsplit(".", 1)[0] if "." in name else ""
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, modules, pkg):
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
    hops = (f"{a} (flint/{a.replace('.', '/')}.py:{graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
    return " -> ".join(hops) + f" -> {cycle[-1]}"


def test_graph_sees_the_import_forms():
    mods = {m: Path() for m in ("a", "b", "c", "d", "e", "__init__")}
    src = ("from flint import a\nfrom . import b, VERSION\nfrom .c import x\nimport flint.d\n"
           "def f():\n    from flint.e import y\n    import os\n    from .kernels.build import build\n")
    got = [t for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))
           for t in _targets(n, mods)]
    assert sorted(got) == ["__init__", "a", "b", "c", "d", "e"]
    mods.update({m: Path() for m in ("server.__init__", "server.app", "server.tools")})
    src = ("from .tools import x\nfrom ..a import y\nfrom .. import b\nfrom flint.server.app import z\n"
           "from ...c import w\nfrom flint import server\n")
    got = [t for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))
           for t in _targets(n, mods, "server")]
    assert sorted(got) == ["a", "b", "server.__init__", "server.app", "server.tools"]
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycles(g) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 10, sorted(graph)
    cycles = find_cycles(graph)
    msg = "\n".join(_describe(c, graph) for c in cycles)
    if cycles:
        print("import cycles among flint's modules:\n" + msg)
    assert not cycles, "import cycles among flint's modules:\n" + msg
