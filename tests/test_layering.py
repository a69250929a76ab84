"""The import graph, lazy imports included (every import statement anywhere in a file): no
cycle between the project's modules, and no arrow pointing up the layers

    sparsespec (engine), evals (benchmarks' data and metrics)   <- neither imports the other
    cluster.peers (external engines driven in their own venv: the standard library only)
    cluster.results (store, migrations, aggregation, reports, policy)
    cluster.sweep (Ray sweeps), cluster.serve (the A/B endpoint)  <- neither imports the other
    cluster.speed (the micro-benchmark)
    dashboard (reads cluster.results only)
    benchmarks (scripts)                                          <- tests import anything

(nothing below imports ``tests``; nothing in ``cluster`` imports ``benchmarks``. The four
benchmark entry scripts ``evals/<benchmark>.py`` are the one exception: scripts that hand their
arguments to ``cluster.sweep.cli`` inside ``main``.) And one writer: within ``cluster.sweep``
no code writes to the store (the sweep's one writer is ``cluster.results.store.SweepRecorder``);
the coordinator hands shard events back (``cluster.results.events``, plain data) and imports
nothing else of ``cluster.results``."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparsespec", "evals", "cluster", "dashboard", "benchmarks")
#: what each layer may import from the project (besides itself); a module's layer is its top
#: package, and for ``cluster`` its sub-package (``cluster`` alone: the bare package)
ALLOWED = {
    "sparsespec": set(),
    "evals": set(),
    "cluster": set(),
    "cluster.peers": set(),
    "cluster.results": {"sparsespec", "evals"},
    "cluster.sweep": {"sparsespec", "evals", "cluster.results", "cluster.peers"},
    "cluster.serve": {"sparsespec", "evals", "cluster.results", "cluster.peers"},
    "cluster.speed": {"sparsespec", "evals", "cluster.results", "cluster.sweep", "cluster.peers"},
    "dashboard": {"sparsespec", "evals", "cluster.results"},
    "benchmarks": {"sparsespec", "evals", "cluster", "cluster.results", "cluster.sweep", "cluster.serve",
                   "cluster.speed", "cluster.peers", "dashboard"},
}
ENTRY_SCRIPTS = {f"evals.{b}" for b in ("ruler", "longbench", "longbench_v2", "infinitebench")}
#: the store's write methods (``cluster.results.store.Store``) a sweep calls
STORE_WRITES = {"start_run", "update_run", "release_running", "finish_run", "start_shard", "complete_shard",
                "fail_shard", "record_event"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "cluster" and len(parts) > 1 else parts[0]


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


def test_every_cluster_module_has_a_layer(graph):
    loose = [m for m in graph if m.startswith("cluster.") and _layer(m) not in ALLOWED]
    assert not loose, f"cluster modules outside results/sweep/serve/speed: {loose}"


def test_no_import_cycle(graph):
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_arrow_points_up(graph):
    bad = []
    for a, b in graph.edges:
        la, lb = _layer(a), _layer(b)
        if a in ENTRY_SCRIPTS and b == "cluster.sweep.cli":
            continue
        if lb == "tests" or (la != lb and lb not in ALLOWED[la]):
            bad.append(f"{a} -> {b}")
    assert not bad, "upward imports: " + ", ".join(sorted(bad))


def test_the_coordinator_and_workers_never_touch_the_store(graph):
    for mod in ("cluster.sweep.coordinator", "cluster.sweep.worker", "cluster.sweep.plan"):
        assert not [d for d in graph.successors(mod)
                    if _layer(d) == "cluster.results" and d != "cluster.results.events"], mod
    # the events are plain data: importing them reaches nothing that writes
    assert not [d for d in graph.successors("cluster.results.events") if d.startswith("cluster.")]


def test_one_place_writes_a_sweep_to_the_store():
    """No code in ``cluster/sweep`` calls a store write; in ``cluster.results.store`` the writes
    a sweep makes are ``SweepRecorder``'s (and ``Store``'s own)."""
    def writers(path: Path) -> list[tuple[str, str, str]]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        owner: dict[ast.AST, str] = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for sub in ast.walk(cls):
                owner[sub] = cls.name
        return [(path.name, owner.get(node, "<module>"), node.func.attr) for node in ast.walk(tree)
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in STORE_WRITES)]

    in_sweep = [w for path in sorted((ROOT / "cluster" / "sweep").rglob("*.py")) for w in writers(path)]
    assert not in_sweep, f"store writes in cluster.sweep (the recorder writes): {in_sweep}"
    recorder = {w[2] for w in writers(ROOT / "cluster" / "results" / "store.py") if w[1] == "SweepRecorder"}
    assert recorder == STORE_WRITES, f"the recorder writes {sorted(recorder)}: has it moved?"


def _sweep_walk():
    spec = importlib.util.spec_from_file_location("sweep_walk", ROOT / "benchmarks" / "sweep_walk.py")
    walk = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, walk)  # its dataclasses look their module up
    spec.loader.exec_module(walk)
    return walk


def test_the_walk_resolves_a_method_by_name_only_on_our_objects(tmp_path):
    """``x.describe()`` enters the one class of ``cluster/`` defining ``describe`` when ``x`` may
    be ours (a parameter), not when ``x`` is a library's object (assigned from a builtin or an
    imported library call): the kernel plan's ``describe()`` once counted as a step into the
    planner."""
    walk = _sweep_walk()
    (tmp_path / "cluster" / "sweep").mkdir(parents=True)
    (tmp_path / "cluster" / "sweep" / "plan.py").write_text(
        "class Shard:\n    def describe(self):\n        return 'shard'\n")
    (tmp_path / "cluster" / "sweep" / "run.py").write_text(
        "import torch\nfrom cluster.sweep import plan\n\n\n"
        "def run_sweep(shard, model):\n"
        "    p = getattr(model, 'kernel_plan', None)\n    p.describe()\n"
        "    t = torch.zeros(1)\n    t.describe()\n"
        "    helper(shard)\n\n\n"
        "def helper(shard):\n    shard.describe()\n")
    back, steps = walk.walk(tmp_path)
    assert [q for _, q in steps] == ["cluster.sweep.run:run_sweep", "cluster.sweep.plan:Shard.describe"]
    assert back == 0
    (tmp_path / "cluster" / "sweep" / "run.py").write_text(  # the library call first: no step
        "import torch\nfrom cluster.sweep import plan\n\n\n"
        "def run_sweep(model):\n    t = torch.zeros(1)\n    t.describe()\n")
    assert [q for _, q in walk.walk(tmp_path)[1]] == ["cluster.sweep.run:run_sweep"]


def test_following_a_sweep_goes_back_into_few_files():
    """``benchmarks/sweep_walk.py``: from ``run_sweep``, how often the walk through the code steps
    back into a file it had left (19 before the split and the one writer, 16 after, 7 since the
    recorder lives with the store and the coordinator owns the Ray session, 4 since a shard carries
    its label and the vLLM methods' names live apart from their engines; reading classes whole, 12,
    9, 7 and 4), and the coordinator never steps into the store."""
    walk = _sweep_walk()
    back, steps = walk.walk(ROOT)
    files = [f for f, _ in steps]
    assert files[0] == "cluster/sweep/run.py" and "cluster/sweep/worker.py" in files
    assert back <= 4, "\n".join(f"{f} {q}" for f, q in steps)
    hops = set(zip(files, files[1:]))
    assert ("cluster/sweep/coordinator.py", "cluster/results/store.py") not in hops
    assert walk.walk(ROOT, by_class=True)[0] <= 4
