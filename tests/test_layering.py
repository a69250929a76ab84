"""The import graph, lazy imports included (every import statement anywhere in a file): no
cycle between the project's modules, and no arrow pointing up the layers

    sparsespec (engine), evals (benchmarks' data and metrics)   <- neither imports the other
    cluster (sweeps, results, serving)
    dashboard
    benchmarks (scripts)                                          <- tests import anything

(``cluster`` may import ``evals`` and ``sparsespec``; nothing below imports ``tests``. The four
benchmark entry scripts ``evals/<benchmark>.py`` are the one exception: scripts that hand their
arguments to ``cluster.sweep.cli`` inside ``main``.)"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparsespec", "evals", "cluster", "dashboard", "benchmarks")
#: what each package may import from the project (besides itself)
ALLOWED = {
    "sparsespec": set(),
    "evals": set(),
    "cluster": {"sparsespec", "evals"},
    "dashboard": {"sparsespec", "evals", "cluster"},
    "benchmarks": {"sparsespec", "evals", "cluster", "dashboard"},
}
ENTRY_SCRIPTS = {f"evals.{b}" for b in ("ruler", "longbench", "longbench_v2", "infinitebench")}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in p.parts:
                out[_module_name(p)] = p
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (the most specific existing module)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            cand = ".".join(parts)
            if cand in modules:
                return cand
            parts.pop()
        return None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        for t in targets:
            top = t.split(".")[0]
            if top == "tests":
                found.add(t)
                continue
            if top not in PACKAGES:
                continue
            r = resolve(t)
            if r is not None and r != name:
                found.add(r)
    return found


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    src = _sources()
    g = nx.DiGraph()
    g.add_nodes_from(src)
    for name, path in src.items():
        for dep in _imports(name, path, set(src)):
            g.add_edge(name, dep)
    return g


def test_the_graph_sees_lazy_imports(graph):
    # cluster.sweep.run imports cluster.results.report inside a function; cluster.results.report
    # imports cluster.results.aggregate at the top
    assert graph.has_edge("cluster.sweep.run", "cluster.results.report")
    assert graph.has_edge("cluster.results.report", "cluster.results.aggregate")


def test_no_import_cycle(graph):
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_arrow_points_up(graph):
    bad = []
    for a, b in graph.edges:
        pa, pb = a.split(".")[0], b.split(".")[0]
        if a in ENTRY_SCRIPTS and b == "cluster.sweep.cli":
            continue
        if pb == "tests" or (pa != pb and pb not in ALLOWED[pa]):
            bad.append(f"{a} -> {b}")
    assert not bad, "upward imports: " + ", ".join(sorted(bad))
