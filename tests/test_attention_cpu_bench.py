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
    assert bench.main(["--batch", "2", "--context", "256", "--widths", "1,3", "--reps", "2", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 layer(s) per call" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    tile = kc.attention_isa()  # what the library runs now
    assert [r.split("|")[1:4] for r in rows] == [[" 1 ", " no ", f" {tile} "], [" 3 ", " no ", f" {tile} "],
                                                 [" 3 ", " yes ", f" {tile} "]]
    for r in rows:  # ms and x roofline positive; GB/s and GFLOP/s numbers (0.0 when rounded on a loaded machine)
        assert r.split("|")[4].strip() == (f"{kc.attention_pv_prefetch()}/{kc.attention_decode_kprefetch()}/"
                                           f"{int(kc.attention_next_kprefetch())}/{kc.attention_verify_kprefetch()}")
        ms, roof, gbs, gflops = (float(c) for c in r.split("|")[5:9])
        assert ms > 0 and roof > 0 and gbs >= 0 and gflops >= 0


@pytest.mark.skipif(not (kc.attention_isa() or "").startswith("avx512"), reason="no AVX-512 tiles in this build")
def test_the_tiles_run_side_by_side_and_an_unknown_tile_is_refused(capsys):
    before = (kc.attention_isa(), kc.attention_kt_rows())
    try:
        assert bench.main(["--batch", "1", "--context", "128", "--widths", "9", "--reps", "1", "--layers", "2",
                           "--tiles", "avx512-kt,avx512,avx2"]) == 0
    finally:
        kc.set_attention_avx512(True)
        kc.set_attention_kt(before[1])
    rows = [line.split("|")[1:4] for line in capsys.readouterr().out.splitlines() if line.startswith("| 9 |")]
    assert [(t.strip(), r.strip()) for _, r, t in rows] == [
        (t, r) for t in ("avx512-kt", "avx512", "avx2") for r in ("no", "yes")]
    with pytest.raises(SystemExit):
        bench.main(["--tiles", "avx1024"])


@pytest.mark.skipif(not kc.available(), reason="our CPU kernels are not built here")
def test_each_call_runs_every_layer_and_times_are_per_layer(monkeypatch, capsys):
    calls = []
    real = kc.attention
    monkeypatch.setattr(kc, "attention", lambda q, k, *a, **kw: calls.append(k.data_ptr()) or real(q, k, *a, **kw))
    assert bench.main(["--batch", "1", "--context", "64", "--widths", "1", "--reps", "1", "--layers", "4"]) == 0
    assert len(calls) == 2 * 4 and len(set(calls)) == 4  # warm-up + 1 rep, each over the 4 layers' own caches
    with pytest.raises(SystemExit):
        bench.main(["--layers", "0"])


@pytest.mark.skipif(not kc.available(), reason="our CPU kernels are not built here")
def test_the_fetch_distances_run_side_by_side_restored_after_and_bad_ones_refused(monkeypatch, capsys):
    seen, real = [], kc.attention
    state = lambda: (kc.attention_pv_prefetch(), kc.attention_decode_kprefetch(), kc.attention_next_kprefetch(),
                     kc.attention_verify_kprefetch())
    monkeypatch.setattr(kc, "attention", lambda q, *a, **kw: seen.append(state()) or real(q, *a, **kw))
    before = state()
    nk, vk = int(before[2]), before[3]  # a PV/DK pair keeps the current next-key fetches
    assert bench.main(["--batch", "1", "--context", "64", "--widths", "1", "--reps", "1", "--layers", "1",
                       "--fetch", f"16/32,0/0,3/200,16/32/{1 - nk},16/32/1/{vk + 2}"]) == 0
    rows = [line.split("|")[4].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert rows == [f"16/32/{nk}/{vk}", f"0/0/{nk}/{vk}", f"3/200/{nk}/{vk}", f"16/32/{1 - nk}/{vk}",
                    f"16/32/1/{vk + 2}"]
    assert set(seen) == {(16, 32, bool(nk), vk), (0, 0, bool(nk), vk), (3, 200, bool(nk), vk),
                         (16, 32, not nk, vk), (16, 32, True, vk + 2)}
    assert state() == before
    import sparsespec.roofline

    measured = []  # a bad argument is refused before the machine is measured (seconds each)
    monkeypatch.setattr(sparsespec.roofline, "measure_machine", lambda *a, **kw: measured.append(a))
    for bad in ("16", "a/b", "-1/0", f"0/{kc.CHUNK + 1}", "16/32/2", f"16/32/1/{kc.CHUNK + 1}", "16/32/1/0/0"):
        with pytest.raises(SystemExit):
            bench.main(["--fetch", bad])
    for bad in (["--layers", "0"], ["--widths", "1,x"], ["--tiles", "avx1024"]):
        with pytest.raises(SystemExit):
            bench.main(bad)
    assert measured == []
