"""The Triton attention kernels on a machine without a GPU.

* parity with the PyTorch references under the Triton CPU interpreter: the cases live in
  ``tests/kernels_interpreted.py`` and run in a subprocess with ``TRITON_INTERPRET=1`` (triton
  fixes compiled-vs-interpreted process-wide when ``triton.language`` is first imported, so running
  them here would leak into other tests, e.g. ``tests/gpu`` in the same session);
* the backend switch (``SPARSESPEC_ATTENTION``);
* (slow) the kernels compile for sm_90 through ptxas, without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsespec import kernels

ROOT = Path(__file__).resolve().parents[1]
# find_spec, not import: this process never imports triton for these checks
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: the Triton kernels cannot be checked")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPARSESPEC_ATTENTION")}
    env.update(extra)
    return env


@needs_triton
def test_kernel_parity_under_the_interpreter():
    """Both kernels (and the engine through them) match the PyTorch path; see kernels_interpreted.py."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          str(ROOT / "tests" / "kernels_interpreted.py")],
                         cwd=ROOT, env=_clean_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=900)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], tail


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("SPARSESPEC_ATTENTION", raising=False)
    assert kernels.backend("cpu") == "torch"  # auto: Triton only on CUDA
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "torch")
    assert kernels.backend("cuda") == "torch"
    monkeypatch.setenv("SPARSESPEC_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="SPARSESPEC_ATTENTION"):
        kernels.backend("cpu")
    if kernels.triton_available():
        monkeypatch.setenv("SPARSESPEC_ATTENTION", "triton")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.backend("cpu")


@pytest.mark.slow
@needs_triton
def test_kernels_compile_for_sm90_without_a_gpu():
    """What the interpreter cannot check: the kernels compile (ptxas, sm_90) for the main launch
    variants; the half-precision ones (the fast path) without spilling registers."""
    res = subprocess.run([sys.executable, "-m", "sparsespec.kernels.compile_check", "--arch", "90"], cwd=ROOT,
                         env=_clean_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    for line in res.stdout.splitlines():
        assert " fp32 " in line or "stack 0 " in line, line
