"""benchmarks/attention_cpu.py: the CPU attention kernel against its roofline (a small shape)."""
import importlib.util
from pathlib import Path

import pytest

from sparsespec.kernels import cpu as kc

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_cpu.py"
_spec = importlib.util.spec_from_file_location("attention_cpu", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.skipif(not kc.available(), reason="our CPU kernels are not built here")
def test_prints_one_row_per_width_and_rows_variant(capsys):
    assert bench.main(["--batch", "2", "--context", "256", "--widths", "1,3", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " no "], [" 3 ", " no "], [" 3 ", " yes "]]
    for r in rows:  # ms, x roofline, GB/s, GFLOP/s: positive numbers
        assert all(float(c) > 0 for c in r.split("|")[3:7])
