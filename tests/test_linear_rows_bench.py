"""benchmarks/linear_rows.py: our packed linear per row count, streamed or on one cache-resident weight."""
import importlib.util
from pathlib import Path

import pytest

from sparsespec.kernels import cpu as kc

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "linear_rows.py"
_spec = importlib.util.spec_from_file_location("linear_rows", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.skipif(not kc.available(), reason="our CPU kernels are not built here")
@pytest.mark.parametrize("tile", ["avx512", "avx2"])
def test_resident_mode_times_one_small_weight_with_the_same_bits_per_tile(capsys, tile):
    before = kc.linear_isa()
    if kc.set_linear_avx512(tile == "avx512") != tile:
        kc.set_linear_avx512(before == "avx512")
        pytest.skip(f"no {tile} linear tile here")
    try:
        assert bench.main(["--resident", "0.1", "--rows", "1,4", "--reps", "2", "--threads", "1"]) == 0
        assert kc.linear_isa() == tile  # the tile the script found, put back
    finally:
        kc.set_linear_avx512(before == "avx512")
    out = capsys.readouterr().out
    assert "one 32 x 576 weight, cache-resident" in out  # SmolLM2's hidden size 576; 0.1 MB -> 32 rows
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 2
    for r in rows:
        assert r[-2].strip() == "True"  # the AVX-512 and AVX2 tiles (or AVX2 alone) give the same bits
        assert all(float(c) > 0 for c in r[2:-2])  # ms and GB/s per tile


def test_a_negative_resident_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--resident", "-1"])
    assert "--resident must be >= 0 MB" in capsys.readouterr().err
