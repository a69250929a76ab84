"""benchmarks/paired_e2e.py: the step-interleaved paired decode (tiny random-weight model)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from sparsespec.engine import Engine
from sparsespec.shapes import random_transformer

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_e2e.py"
_spec = importlib.util.spec_from_file_location("paired_e2e", _PATH)
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


def test_parse_methods_puts_ar_first_and_rejects_bad_k():
    assert paired.parse_methods("sparsespec-l:2,ngram,sparsespec-l:auto,ar,sparsespec-l:2") == [
        ("ar", {}), ("sparsespec-l", {"k": 2}), ("ngram", {"k": 4}), ("sparsespec-l", {"k": "auto"})]
    for bad in ("sparsespec-l:0", "sparsespec-l:x", "sparsespec-l:-1"):
        with pytest.raises(ValueError, match="k must be"):
            paired.parse_methods(bad)


class _FakeClock:
    """Advances 1 s per read: every step of every core then costs exactly 1 s of its own time."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return Engine(random_transformer("tiny", seed=0), paired.IdTokenizer(), name="random:tiny")


@pytest.mark.parametrize("schedule", ["step", "run"])
def test_cells_are_lossless_and_each_core_is_timed_by_its_own_steps(engine, schedule):
    methods = paired.parse_methods("sparsespec-l:2,ngram:3")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, engine.model.cfg.vocab_size, (3, 48), generator=g).tolist()
    res = paired.run_cell(engine, methods, prompts, gen_tokens=9, window=64, schedule=schedule)
    assert set(res) == {"ar", "sparsespec-l k=2", "ngram k=3"}
    for key, r in res.items():
        assert r["tokens"] == res["ar"]["tokens"], key  # greedy speculation is lossless
        assert all(len(t) == 9 for t in r["tokens"])
    assert res["sparsespec-l k=2"]["alpha"] is not None and res["sparsespec-l k=2"]["mean_k"] > 0  # it drafted
    assert res["ar"]["alpha"] is None


def test_interleaved_time_is_each_cores_own(engine):
    """Under the step schedule the cores share one wall clock; each core's TPOT must count only
    its own steps: with a runner clock that moves 1 s per read, a core's wall is 1 s per step
    (not the time since the cell started), and a method taking fewer steps than ar gets less."""
    clock = _FakeClock()
    methods = paired.parse_methods("sparsespec-l:2")
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, engine.model.cfg.vocab_size, (2, 40), generator=g).tolist()
    runs = [paired._Run(engine, n, o, prompts, 7, 64) for n, o in methods]
    turn = 0
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step(clock)
        turn += 1
    ar, spec = runs
    assert ar.wall_s == ar.core.num_steps * 1.0  # 2 reads of the runner's clock per step, 1 s apart
    assert spec.wall_s == spec.core.num_steps * 1.0
    assert spec.core.num_steps < ar.core.num_steps  # it drafted and accepted something
    res = ar.result()
    stats = [o.stats for o in ar.outputs.values()]
    prefill = sum(s["prefill_s"] for s in stats)
    assert res["tpot_s"] == pytest.approx((ar.wall_s - prefill) / (2 * 6))


def test_summarise_pairs_each_repetition_with_its_own_ar():
    methods = [("ar", {}), ("x", {"k": 2})]
    base = {"alpha": None, "tau": 1.0, "mean_k": None, "gamma": None, "k_hist": None, "tokens": [[1]]}
    reps = [{"ar": {**base, "tpot_s": 2.0}, "x k=2": {**base, "tpot_s": 1.0}},
            {"ar": {**base, "tpot_s": 4.0}, "x k=2": {**base, "tpot_s": 5.0}},
            {"ar": {**base, "tpot_s": 3.0}, "x k=2": {**base, "tpot_s": 1.0, "tokens": [[2]]}}]
    rows = paired.summarise(reps, methods)
    x = rows[1]
    assert x["speedups"] == [2.0, 0.8, 3.0]
    assert x["speedup"] == 2.0  # the median of the paired ratios, not a ratio of medians (3 / 1)
    assert x["tpot_s"] == 1.0
    assert x["same_tokens"] is False  # one repetition diverged
    assert rows[0]["speedup"] == 1.0 and rows[0]["same_tokens"] is True


def test_main_writes_a_row_per_method_with_the_machine(tmp_path, monkeypatch, capsys):
    import sparsespec.roofline

    monkeypatch.setattr(sparsespec.roofline, "measure_machine",
                        lambda device, dtype, reps=3: {"read_bytes_per_s": 2e10, "gemm_flops_per_s": 1e11})
    out = tmp_path / "e2e.json"
    # 4096 = the tiny shape's whole window (prompt + generated tokens fill it exactly)
    assert paired.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2",
                        "--context-lengths", "56,4096", "--max-batch-tokens", "4096", "--methods",
                        "sparsespec-l:2", "--gen-tokens", "8", "--reps", "2", "--json-out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert data["meta"]["cpu"] and data["meta"]["isa"] is not None and data["meta"]["schedule"] == "step"
    assert data["meta"]["read_bytes_per_s"] == 2e10
    assert [(r["batch_size"], r["context_len"], r["method"], r["k"]) for r in data["rows"]] == [
        (1, 56, "ar", 0), (1, 56, "sparsespec-l", 2), (1, 4096, "ar", 0), (1, 4096, "sparsespec-l", 2),
        (2, 56, "ar", 0), (2, 56, "sparsespec-l", 2)]
    assert all(r["same_tokens"] for r in data["rows"]) and len(data["rows"][1]["speedups"]) == 2
    printed = capsys.readouterr().out
    assert "skipped: 2 x 4096 > --max-batch-tokens 4096" in printed and "| 2 | 56 | sparsespec-l k=2 |" in printed


def test_warmup_cells_run_untimed_before_each_batch_size(tmp_path, monkeypatch):
    """--warmup N: N short cells (every method, at most 8 tokens, the shortest context up to 2048)
    per batch size before its timed cells, outside the rows; none by default on the CPU."""
    import json

    import sparsespec.roofline

    monkeypatch.setattr(sparsespec.roofline, "measure_machine",
                        lambda device, dtype, reps=3: {"read_bytes_per_s": 2e10, "gemm_flops_per_s": 1e11})
    calls, real = [], paired.run_cell

    def spy(engine, methods, prompts, gen_tokens, window, schedule):
        calls.append((len(prompts), len(prompts[0]) + gen_tokens, gen_tokens, tuple(m for m, _ in methods)))
        return real(engine, methods, prompts, gen_tokens, window, schedule)

    monkeypatch.setattr(paired, "run_cell", spy)
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2", "--context-lengths",
            "64,56", "--methods", "sparsespec-l:2", "--gen-tokens", "12", "--reps", "1"]
    out = tmp_path / "w.json"
    assert paired.main([*args, "--warmup", "2", "--json-out", str(out)]) == 0
    m = ("ar", "sparsespec-l")
    assert calls == [(1, 56, 8, m), (1, 56, 8, m), (1, 64, 12, m), (1, 56, 12, m),
                     (2, 56, 8, m), (2, 56, 8, m), (2, 64, 12, m), (2, 56, 12, m)]
    data = json.loads(out.read_text())
    assert data["meta"]["warmup"] == 2 and len(data["rows"]) == 8  # 2 batch sizes x 2 contexts x 2 methods
    calls.clear()
    assert paired.main(args) == 0
    assert [c[:3] for c in calls] == [(1, 64, 12), (1, 56, 12), (2, 64, 12), (2, 56, 12)]
    with pytest.raises(SystemExit):
        paired.main([*args, "--warmup", "-1"])


def test_warmup_skips_contexts_that_cannot_run(monkeypatch, capsys):
    """A context shorter than the new tokens is reported as skipped; the warm-up uses a runnable one."""
    import sparsespec.roofline

    monkeypatch.setattr(sparsespec.roofline, "measure_machine",
                        lambda device, dtype, reps=3: {"read_bytes_per_s": 2e10, "gemm_flops_per_s": 1e11})
    calls, real = [], paired.run_cell

    def spy(engine, methods, prompts, gen_tokens, window, schedule):
        calls.append((len(prompts[0]) + gen_tokens, gen_tokens))
        return real(engine, methods, prompts, gen_tokens, window, schedule)

    monkeypatch.setattr(paired, "run_cell", spy)
    assert paired.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1",
                        "--context-lengths", "6,56", "--methods", "sparsespec-l:2", "--gen-tokens", "12",
                        "--reps", "1", "--warmup", "1"]) == 0
    assert calls == [(56, 8), (56, 12)]
    assert "| 1 | 6 | (skipped: needs 1 <= prompt" in capsys.readouterr().out
