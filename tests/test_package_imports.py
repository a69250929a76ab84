"""``import sparsespec`` is light (its names load on first use), so the store's readers and the CLIs'
``--help`` start without torch; every exported name still resolves to its module's object."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import sparsespec

ROOT = Path(__file__).resolve().parents[1]


def _heavy_after(code: str) -> list[str]:
    probe = code + "\nimport sys\nprint(','.join(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_package_and_the_store_readers_do_not_import_torch():
    assert _heavy_after("import sparsespec, sparsespec.registry, sparsespec.stats, sparsespec.config") == []
    assert _heavy_after("import cluster.results.report, cluster.results.aggregate") == []
    # the first read of an engine name loads the engine (and torch)
    assert "torch" in _heavy_after("from sparsespec import Engine")


@pytest.mark.parametrize("name", sorted(set(sparsespec.__all__) - {"METHODS"}))
def test_every_exported_name_is_its_modules_object(name):
    module = importlib.import_module(sparsespec._EXPORTS[name])
    assert getattr(sparsespec, name) is getattr(module, name)


def test_methods_and_submodules_and_unknown_names():
    from sparsespec.engine import methods

    assert sparsespec.METHODS == tuple(methods())
    assert {"ar", "sparsespec-l", "ngram", "eagle3"} <= set(sparsespec.METHODS)
    assert sparsespec.kernels is importlib.import_module("sparsespec.kernels")
    assert "Engine" in dir(sparsespec)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        sparsespec.no_such_name  # noqa: B018
