"""The shape of the code, read from the source files with `ast` (nothing is imported):
no import cycles in `mlxinfer/` and `convert/`, counting the imports inside functions too
(a lazy import that climbs back up is still a cycle), `mlxinfer.base.blas` free of MLX, and no
file that reaches outside the checkout."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlxinfer",)  # the converter among them: mlxinfer/convert links to the top-level convert/


def source_modules() -> dict[str, Path | None]:
    """Dotted module name -> source file, for every module of our packages; compiled
    extensions that setup.py declares map to None (they import nothing of ours)."""
    modules: dict[str, Path | None] = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(ROOT / package, followlinks=True):  # mlxinfer/convert is a link
            for path in (Path(folder) / n for n in names if n.endswith(".py")):
                parts = path.relative_to(ROOT).with_suffix("").parts
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension":
            modules[node.args[0].value] = None
    return modules


def imported(path: Path, module: str, modules: dict[str, Path | None]) -> set[str]:
    """Our modules that `module` imports anywhere in its file. `from p import x` is an edge to
    `p.x` when that is a module, else to `p` (x is a name defined there)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {ours(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found |= {ours(f"{base}.{alias.name}") for alias in node.names}
    return {m for m in found if m is not None and m != module}


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {m: imported(p, m, modules) if p else set() for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions():
    """The oracle itself: a lazy import inside a function is an edge, and a known edge is found."""
    graph = import_graph()
    assert "mlxinfer.kernels.quantized_matmul" in graph and "mlxinfer.kernels._cpu_qmm" in graph
    assert "mlxinfer.kernels._cpu_qmm" in graph["mlxinfer.kernels.quantized_matmul"]  # imported inside a function
    assert "mlxinfer.cli.store" in graph["mlxinfer.cli.main"]  # likewise, only inside commands
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert cycles(graph) == [], "modules that import each other (directly or round a loop)"


def mlx_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = [alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    return [n for n in names if n == "mlx" or n.startswith("mlx.")]


def test_blas_does_not_import_mlx():
    """`mlxinfer.base.blas` chooses MLX's BLAS before mlx.core loads, so neither it nor anything
    of ours it imports may import MLX."""
    graph, modules = import_graph(), source_modules()
    reached, todo = set(), ["mlxinfer.base.blas"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert {m: mlx_imports(modules[m]) for m in reached if modules[m] and mlx_imports(modules[m])} == {}


def climbs_out(path: Path) -> list[int]:
    """The lines of `path` that take an ancestor of its own file above the checkout
    (`Path(__file__).parents[n]` past the root)."""
    top = len(path.relative_to(ROOT).parts) - 1  # parents[top] is the checkout's root
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)
                and node.slice.value > top
                and any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node.value))):
            lines.append(node.lineno)
    return lines


def test_nothing_reads_beside_the_checkout():
    """A fresh clone has nothing beside it (the folder the developers' tests once read their real
    tokenizers from is not there): what tests and benchmarks need comes from package registries
    into the test-asset cache (tests/conftest.py), never from a path above the checkout."""
    files = [*ROOT.glob("*.py"), *(p for folder in (*PACKAGES, "tests", "benchmarks", "examples", "_build")
                                   for p in (ROOT / folder).rglob("*.py"))]
    assert [f"{p.relative_to(ROOT)}:{line}" for p in files for line in climbs_out(p)] == []
