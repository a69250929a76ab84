"""`import evals` (and every module of it) stays light: no Ray, SQL, Streamlit or the engine; only
the four entry scripts ``evals/<benchmark>.py`` touch ``cluster`` (lazily, inside ``main``)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVALS = ROOT / "evals"
ENTRY_SCRIPTS = {"ruler.py", "longbench.py", "longbench_v2.py", "infinitebench.py"}
FORBIDDEN = ("cluster", "sparsespec", "ray", "sqlalchemy", "streamlit")


def _modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in EVALS.rglob("*.py")
    )


def test_evals_imports_no_heavy_or_engine_packages():
    mods = _modules()
    assert {"evals.registry", "evals.benchmarks.ruler", "evals.benchmarks.longbench", "evals.ruler"} <= set(mods)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "from evals.registry import BENCHMARKS\n"
        "assert {'infinitebench', 'longbench', 'longbench_v2', 'ruler'} <= set(BENCHMARKS)\n"
        f"bad = [m for m in {FORBIDDEN + ('torch', 'transformers', 'datasets')!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"evals imported: {out.stdout.strip()}"


def _imported(path: Path) -> set[str]:
    """Top-level package of every import statement anywhere in the file (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_entry_scripts_import_cluster():
    for path in sorted(EVALS.rglob("*.py")):
        rel = path.relative_to(EVALS)
        found = _imported(path) & set(FORBIDDEN)
        if rel.parent == Path(".") and rel.name in ENTRY_SCRIPTS:
            assert found == {"cluster"}, f"{rel}: {sorted(found)}"
        else:
            assert not found, f"evals/{rel} imports {sorted(found)}"


def test_entry_scripts_are_a_few_lines():
    for name in ENTRY_SCRIPTS:
        text = (EVALS / name).read_text(encoding="utf-8")
        code = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        assert len(code) < 25, name
        assert f'benchmark_main("{name[:-3]}", argv)' in text
