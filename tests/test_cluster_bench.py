"""cluster.speed.measure: roofline arithmetic (``sparsespec.roofline``), flag validation, the step timings,
and the end-to-end part as a sweep of the ``speed`` benchmark (same run ids, pairing, lossless
check and report as any sweep; resumable)."""
from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from cluster.speed import measure as bench
from cluster.speed.measure import BenchConfig
from cluster.results.report import report_rows
from cluster.results.store import open_store
from helpers import tiny_model_like
import sparsespec.roofline as rl
from sparsespec.roofline import (kv_bytes, max_speedup, roofline, roofline_speedup, step_flops, weight_bytes,
                                 x_roofline)
from sparsespec.shapes import SHAPES, random_transformer


def test_weight_bytes_counts_a_tied_head_once_and_skips_an_untied_input_embedding():
    tiny = random_transformer("tiny")  # tied: V=512, E=64, L=2, H=4, H_kv=2, D=16, I=128
    cfg = tiny.cfg
    per_layer = (4 + 2 * 2) * 16 * 64 + 64 * 4 * 16 + 2 * 128 * 64 + 64 * 128 + 2 * 64
    expected = (512 * 64 + 64 + 2 * per_layer) * 4
    assert weight_bytes(tiny) == expected
    untied = random_transformer(SHAPES["tiny"].__class__(**{**SHAPES["tiny"].__dict__, "tie_word_embeddings": False}))
    # the untied model has one more V x E matrix, but the input embedding is only gathered
    assert weight_bytes(untied) == expected
    assert cfg.num_layers == 2


def test_kv_bytes_and_flops_by_hand():
    cfg = SHAPES["llama-3.1-8b"]
    # 32 layers x (K and V) x 8 KV heads x 128 dims x 2 bytes = 131072 bytes per token
    assert kv_bytes(cfg, 2, 1, 1) == 131072
    assert kv_bytes(cfg, 2, 4, 32768) == 4 * 32768 * 131072
    tiny = random_transformer("tiny")
    linear = 2 * ((4 + 4) * 16 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128) + 512 * 64
    attn = 4 * 2 * 4 * 16 * 100  # QK^T and PV: 2 * 2 flops per (layer, head, dim, key)
    assert step_flops(tiny, batch=3, tokens=5, keys=100) == 2.0 * 15 * linear + 15 * attn
    # a prefill needs logits for its last position only: the V x E head runs once per row, not 5 times
    machine = {"read_bytes_per_s": 1e30, "gemm_flops_per_s": 1.0}
    head = 512 * 64
    assert roofline(tiny, machine, 3, 5, 100, logit_tokens=1)["compute_s"] == \
        2.0 * 3 * (5 * (linear - head) + head) + 15 * attn
    assert roofline(tiny, machine, 3, 5, 100)["compute_s"] == 2.0 * 15 * linear + 15 * attn


def test_roofline_is_the_larger_of_the_memory_and_compute_floors():
    tiny = random_transformer("tiny")
    machine = {"read_bytes_per_s": 1e9, "gemm_flops_per_s": 1e12}
    r = roofline(tiny, machine, batch=2, tokens=1, kv_positions=1000)
    assert r["bytes"] == weight_bytes(tiny) + kv_bytes(tiny.cfg, 4, 2, 1000)
    assert math.isclose(r["mem_s"], r["bytes"] / 1e9)
    assert r["roofline_s"] == max(r["mem_s"], r["compute_s"])
    slow_compute = roofline(tiny, {"read_bytes_per_s": 1e12, "gemm_flops_per_s": 1e6}, 2, 1, 1000)
    assert slow_compute["roofline_s"] == slow_compute["compute_s"] > slow_compute["mem_s"]


def test_roofline_speedup_by_hand():
    # tau = 3 tokens per cycle of mean_k = 4 drafts (1 ms each) + one 12 ms verify, vs 10 ms AR steps
    assert roofline_speedup(3.0, 4.0, 10e-3, 1e-3, 12e-3) == pytest.approx(3 * 10 / (4 * 1 + 12))
    # every draft accepted at k = 4: 5 tokens per cycle
    assert max_speedup(4, 10e-3, 1e-3, 12e-3) == pytest.approx(5 * 10 / 16) == roofline_speedup(5, 4, 10e-3, 1e-3, 12e-3)
    assert roofline_speedup(None, 4.0, 1.0, 1.0, 1.0) is None and roofline_speedup(1.0, 0.0, 1.0, 1.0, 0.0) is None
    assert x_roofline(3e-3, 1.5e-3) == pytest.approx(2.0) and x_roofline(1.0, 0.0) is None


def test_roofline_best_k_by_hand():
    flat = {str(k): 1.0 for k in range(0, 17)}  # a memory-bound verify: the floor does not grow with k
    # alpha 1, drafts free: every k emits k+1 tokens for one verify: the longest k
    assert bench.roofline_best_k(1.0, 1.0, 0.0, flat) == (16, pytest.approx(17.0))
    assert bench.roofline_best_k(0.0, 1.0, 0.1, flat) == (0, 1.0)  # nothing accepted: plain decoding
    assert bench.roofline_best_k(None, 1.0, 0.1, flat) == (None, None)
    # compute-bound verify: floor 0.5 + 0.5 (k + 1) (k=0: 1.0 = the AR floor), draft 0.2, alpha 0.8
    lin = {str(k): 0.5 + 0.5 * (k + 1) for k in range(0, 17)}
    # S(1) = 1.8 / 1.7 = 1.059, S(2) = 2.44 / 2.4 = 1.017, S(3) = 2.952 / 3.1 = 0.952
    k, s = bench.roofline_best_k(0.8, 1.0, 0.2, lin)
    assert k == 1 and s == pytest.approx(1.8 / 1.7)


def test_verify_floor_interpolates_at_a_fractional_mean_k():
    by_k = {"0": 1.0, "1": 2.0, "2": 4.0, "3": 5.0}
    assert bench.verify_floor_at(by_k, 2.0) == 4.0
    assert bench.verify_floor_at(by_k, 1.25) == pytest.approx(2.5)
    assert bench.verify_floor_at(by_k, 3.5) is None  # past the table
    assert bench.expected_tokens(0.5, 2) == pytest.approx(1.75) and bench.expected_tokens(1.0, 3) == 4.0


def test_the_gemm_rate_is_the_fastest_correct_gemm_here(monkeypatch):
    """measure_machine's compute floor comes from the fastest GEMM this process runs (on an AMD
    CPU MKL's ``a @ b`` runs AVX2 code at half our packed linear's rate), and a backend whose
    product is wrong is no candidate, however fast."""
    from sparsespec.kernels import cpu

    m = rl.measure_machine("cpu", torch.float32, reps=1)
    rates = m["gemm_rates"]
    assert "torch" in rates and m["gemm_backend"] in rates
    assert m["gemm_flops_per_s"] == max(rates.values()) == rates[m["gemm_backend"]]
    if cpu.available():
        assert "ss" in rates
        monkeypatch.setattr(cpu, "linear_packed", lambda x, wp, n, *a, **k: torch.zeros(x.shape[0], n))
        assert "ss" not in rl.measure_machine("cpu", torch.float32, reps=1)["gemm_rates"]
    # bf16: our kernels are fp32 only
    assert "ss" not in rl.measure_machine("cpu", torch.bfloat16, reps=1)["gemm_rates"]


def test_the_cpu_gemm_probe_is_the_smallest_product_that_takes_long_enough(monkeypatch):
    """n = the first of 512, 1024, 2048 whose product takes GEMM_PROBE_MIN_S (a bf16 product on a
    CPU without bf16 instructions took 195 s of probing at 2048), else 2048; the result says which."""
    monkeypatch.setattr(rl, "GEMM_PROBE_MIN_S", 0.0)
    assert rl._cpu_gemm_n(torch.float32) == 512
    assert rl.measure_machine("cpu", torch.float32, reps=1)["gemm_n"] == 512
    monkeypatch.setattr(rl, "GEMM_PROBE_MIN_S", 1e9)
    assert rl._cpu_gemm_n(torch.float32, sizes=(64, 128)) == 128
    calls = []  # each size is timed on its second call (the first warms the pools), smallest first
    real = time.perf_counter
    monkeypatch.setattr(rl.time, "perf_counter", lambda: calls.append(1) or real())
    monkeypatch.setattr(rl, "GEMM_PROBE_MIN_S", 0.0)
    assert rl._cpu_gemm_n(torch.float32, sizes=(64, 128)) == 64 and len(calls) == 2


def test_rooflines_are_recomputed_at_the_best_rates_of_the_run():
    tiny = random_transformer("tiny")
    samples = [{"read_bytes_per_s": 2e9, "gemm_flops_per_s": 5e11, "gemm_backend": "torch"},
               {"read_bytes_per_s": 1e9, "gemm_flops_per_s": 9e11, "gemm_backend": "ss"}]
    assert bench.best_rates(samples) == {"read_bytes_per_s": 2e9, "gemm_flops_per_s": 9e11, "gemm_backend": "ss",
                                         "gemm_n": None}
    assert bench.best_rates([samples[0], {**samples[1], "gemm_n": 1024}])["gemm_n"] == 1024  # the fastest's size
    row = {"batch_size": 2, "prompt_len": 1000, "k": 3, "n_index": 128, "prefill_s": 0.5, "ar_step_s": 0.01,
           "verify_importance_s": 0.03, "draft_step_s": 0.004, "draft_step_int8_s": 0.003, "gamma": 0.004 / 0.03,
           "_draft_int8_roofline_weight_bytes": 1000}
    slow = bench.add_rooflines(dict(row), tiny, samples[1])
    best = bench.add_rooflines(dict(row), tiny, bench.best_rates(samples))
    # twice the bandwidth: half the memory floor, so the same seconds are twice as far from it
    assert best["ar_step_mem_roofline_s"] == pytest.approx(slow["ar_step_mem_roofline_s"] / 2)
    assert best["ar_step_mem_roofline_s"] == pytest.approx(best["ar_step_bytes"] / 2e9)
    assert best["ar_step_x_mem"] == pytest.approx(2 * slow["ar_step_x_mem"])
    assert best["prefill_x_roofline"] == pytest.approx(0.5 / best["prefill_roofline_s"])
    assert best["gamma_over_roofline"] == pytest.approx(best["gamma"] / best["gamma_roofline"])
    # no bandwidth sampled beside the steps: nothing to judge them by
    assert best["ar_step_x_roofline_beside"] is None and best["verify_x_roofline_beside"] is None
    # sampled at the slow sample's rate: against that floor, not the run's best
    # each step against the rate sampled between its own reps (here: AR in a slow second, the others not)
    beside = bench.add_rooflines({**row, "ar_step_read_beside_bytes_per_s": 1e9, "verify_read_beside_bytes_per_s": 2e9,
                                  "draft_step_read_beside_bytes_per_s": 2e9}, tiny, bench.best_rates(samples))
    at_slow = bench.add_rooflines(dict(row), tiny, {**bench.best_rates(samples), "read_bytes_per_s": 1e9})
    for name in ("ar_step", "verify", "draft_step"):
        assert beside[f"{name}_x_roofline"] == pytest.approx(best[f"{name}_x_roofline"])
    assert beside["ar_step_x_roofline_beside"] == pytest.approx(at_slow["ar_step_x_roofline"])
    assert beside["ar_step_x_roofline_beside"] < beside["ar_step_x_roofline"]  # a memory-bound step here
    for name in ("verify", "draft_step"):
        assert beside[f"{name}_x_roofline_beside"] == pytest.approx(best[f"{name}_x_roofline"])
    # and the GEMM rate sampled beside them: the verify in a slow minute of the host's arithmetic
    # (compute-bound at 1 MFLOP/s) against the floor at that rate, the others at the run's
    reads = {f"{n}_read_beside_bytes_per_s": 2e9 for n in ("ar_step", "verify", "draft_step")}
    slow_gemm = bench.add_rooflines({**row, **reads, "verify_gemm_beside_flops_per_s": 1e6,
                                     "ar_step_gemm_beside_flops_per_s": None}, tiny, bench.best_rates(samples))
    at_slow_gemm = bench.add_rooflines(dict(row), tiny, {**bench.best_rates(samples), "gemm_flops_per_s": 1e6})
    assert slow_gemm["verify_x_roofline_beside"] == pytest.approx(at_slow_gemm["verify_x_roofline"])
    assert slow_gemm["verify_x_roofline_beside"] < 0.1 * slow_gemm["verify_x_roofline"]
    for name in ("ar_step", "draft_step"):
        assert slow_gemm[f"{name}_x_roofline_beside"] == pytest.approx(best[f"{name}_x_roofline"])


def test_the_read_probe_samples_between_reps_and_outside_the_timing():
    calls: list[str] = []
    probe = rl.ReadProbe("cpu", nbytes=1 << 20)
    assert probe.median() is None and probe.spread() is None

    def between():
        calls.append("probe")
        probe.tagged("a")()

    assert rl.time_call(lambda: calls.append("fn"), "cpu", reps=3, warmup=1, between=between) >= 0
    assert calls == ["fn", "fn", "probe", "fn", "probe", "fn", "probe"]  # the warm-up has none
    assert len(probe.samples["a"]) == 3 and all(r > 0 for r in probe.samples["a"])
    assert probe.median("a") == sorted(probe.samples["a"])[1] and probe.spread("a") >= 1.0
    probe.samples = {"a": [2e9, 1e9, 4e9], "b": [8e9]}
    assert probe.median("a") == 2e9 and probe.spread("a") == 4.0  # one step's samples
    assert probe.median() == 3e9 and probe.spread() == 8.0  # every sample
    assert probe.median("c") is None and probe.spread("c") is None
    with pytest.raises(ValueError, match="nbytes"):
        rl.ReadProbe("cpu", nbytes=2)
    assert probe.gemm_median() is None and probe.gemm_spread("a") is None  # no GEMM given: none sampled


def test_the_probe_samples_the_gemm_beside_the_read():
    products = []
    probe = rl.ReadProbe("cpu", nbytes=1 << 20, gemm=(lambda: products.append(1), 2e6))
    for tag in ("a", "a", "b"):
        probe(tag)
    assert len(products) == 3 and {t: len(v) for t, v in probe.gemm_samples.items()} == {"a": 2, "b": 1}
    assert all(r > 0 for v in probe.gemm_samples.values() for r in v) and len(probe.samples["a"]) == 2
    probe.gemm_samples = {"a": [1e9, 3e9], "b": [4e9]}
    assert probe.gemm_median("a") == 2e9 and probe.gemm_spread("a") == 3.0 and probe.gemm_median() == 3e9
    call, flops = rl.gemm_call("cpu", torch.float32, "no-such-backend", n=64)  # unknown here: torch's product
    assert flops == 2 * 64**3 and tuple(call().shape) == (64, 64)
    call, _ = rl.gemm_call("cpu", torch.float32, "torch", n=32)
    assert tuple(call().shape) == (32, 32)


def test_markdown_has_the_physics_and_reference_columns():
    result = {"meta": {"date": "d", "machine_desc": "m", "torch": "t", "threads": 2, "model": "x",
                       "config": {"dtype": "float32"}, "e2e": {"run_ids": ["r"], "done": 1}},
              "machine": {"read_bytes_per_s": 1e10, "gemm_flops_per_s": 1e11},
              "rows": [{"kind": "peer", "engine": "vllm", "method": "vllm:ngram", "context_len": 256, "batch_size": 4,
                        "decode_ms_per_step": 20.0, "over_ours_ar": 1.25, "same_tokens_as_ours": True,
                        "spec_decode": {"acceptance_rate": 0.5}},
                       {"kind": "peer", "engine": "vllm", "method": "vllm:ar", "context_len": 256, "batch_size": 4,
                        "error": "no .venv-peers: run make peers"},
                       {"kind": "e2e", "method": "sparsespec-l", "context_len": 256, "batch_size": 1, "n": 1,
                        "decode_tokens_per_s": 10.0, "speedup": 0.9, "speedup_runs": [0.9], "alpha": 0.8,
                        "tau": 2.0, "mean_k": 2.0, "gamma": 0.3, "roofline_speedup": 1.2,
                        "measured_over_roofline": 0.75, "roofline_best_k": 3, "roofline_best_speedup": 1.31,
                        "straggle": 0.9, "lossless_rate": 1.0}]}
    md = bench.markdown(result)
    assert "| measured / roofline | roofline k (S) | straggle |" in md and "| 0.75 | 3 (1.31) | 0.900 | 100 % |" in md
    assert "| 256 | 4 | vllm:ngram | 20.0 | 1.25 | yes | accept rate 0.50 |" in md
    assert "| 256 | 4 | vllm:ar | - | - | - | no .venv-peers: run make peers |" in md


def test_the_roofline_module_needs_no_ray_or_sql():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, sparsespec.roofline\n"
            "print(','.join(m for m in ('ray', 'sqlalchemy', 'cluster', 'streamlit') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == ""


def test_a_steps_only_run_needs_no_ray_or_pydantic(tmp_path):
    """GPU images without the sweep layer's packages (the H200 one has neither) still time the steps."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, runpy\n"
            "for m in ('ray', 'pydantic'): sys.modules[m] = None  # import fails as if not installed\n"
            "sys.argv = ['cluster.speed', '--shape', 'tiny', '--random-weights', '--steps-only', '--context-lengths',"
            " '128', '--batch-sizes', '1', '--k', '2', '--reps', '1', '--warmup', '0', '--gen-tokens', '4',"
            " '--threads', '1', '--peers', 'none', '--db', '']\n"
            "runpy.run_module('cluster.speed', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| ctx (prompt) | B |" in out.stdout


@pytest.mark.parametrize("kwargs, msg", [
    ({"random_weights": True}, "needs --shape"),
    ({"context_lengths": (32,)}, "context lengths"),
    ({"context_lengths": (100,), "gen_tokens": 64}, r"gen_tokens \+ 64"),
    ({"context_lengths": (256, 256)}, "duplicate context lengths"),
    ({"batch_sizes": (0,)}, "batch sizes"),
    ({"k": 0}, "k must be"),
    ({"budget_frac": 0.0}, "budget_frac"),
    ({"gen_tokens": 1}, "gen_tokens"),
    ({"e2e_samples": 0}, "e2e_samples"),
    ({"device": "tpu"}, "device"),
    ({"quantize": "int4"}, "quantize must be one of"),
    ({"peer_tokens": 1}, "peer_tokens must be >= 2"),
    ({"peer_ngram_k": 0}, "peer_ngram_k"),
    ({"peers": ("sglang",)}, "unknown peer"),
])
def test_config_rejects_bad_values(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        BenchConfig(**kwargs)


def test_cli_rejects_unknown_method_and_bad_lists(capsys):
    assert bench.main(["--methods", "sparsespec-x", "--shape", "tiny", "--random-weights", "--db", ""]) == 2
    assert "unknown method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--context-lengths", "1k"])
    with pytest.raises(SystemExit):
        bench.main(["--random-weights"])  # no --shape


def test_random_weights_measure_every_step_and_store_them_without_an_e2e_run(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    out = tmp_path / "bench.json"
    rc = bench.main(["--shape", "tiny", "--random-weights", "--context-lengths", "256", "--batch-sizes", "1,2",
                     "--methods", "sparsespec-l", "--k", "3", "--reps", "1", "--warmup", "0",
                     "--gen-tokens", "6", "--db", db, "--json-out", str(out), "--threads", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| ctx (prompt) | B |" in printed and "stored as run bench-" in printed
    result = json.loads(out.read_text())
    m = result["machine"]
    assert m["read_bytes_per_s"] > 0 and m["gemm_flops_per_s"] > 0
    # sampled at the start and after each of the 2 cells; the roofline uses the best samples
    assert len(m["samples"]) == 3
    assert m["read_bytes_per_s"] == max(x["read_bytes_per_s"] for x in m["samples"])
    assert m["gemm_flops_per_s"] == max(x["gemm_flops_per_s"] for x in m["samples"])
    assert "_draft_int8_roofline_weight_bytes" not in json.dumps(result["rows"])
    assert result["meta"]["e2e"] is None  # random weights: steps only (no tokenizer for the book)
    steps = [r for r in result["rows"] if r["kind"] == "steps"]
    assert [r["kind"] for r in result["rows"]] == ["steps", "steps"]
    assert [(r["context_len"], r["prompt_len"], r["batch_size"]) for r in steps] == [(256, 250, 1), (256, 250, 2)]
    for r in steps:
        for key in ("ar_step_s", "verify_s", "verify_importance_s", "draft_step_s", "gather_s",
                    "index_update_s", "index_rebuild_s"):
            assert r[key] > 0, key
        assert r["n_index"] == 128  # 10 % of 250 is under the 128-token floor
        assert r["ar_step_x_roofline"] > 0 and r["gamma_roofline"] > 0
        # the draft reads the index, the verify the whole context: the roofline says drafting is cheaper
        assert r["draft_step_bytes"] < r["verify_bytes"]
        # the int8 draft: timed on the same index, its roofline reads the int8 copy instead of the weights
        assert r["draft_step_int8_s"] > 0 and r["gamma_int8"] == pytest.approx(
            r["draft_step_int8_s"] / r["verify_importance_s"])
        assert 0 < r["draft_weight_int8_bytes"] and r["draft_step_int8_bytes"] < r["draft_step_bytes"]
        assert r["roofline_max_speedup"] == pytest.approx(max_speedup(
            3, r["ar_step_roofline_s"], r["draft_step_roofline_s"], r["verify_roofline_s"]))
        # every row's floors are at the run's best rates (not at the rates of the moment it ran)
        assert r["read_bytes_per_s"] == m["read_bytes_per_s"]
        assert r["ar_step_mem_roofline_s"] == pytest.approx(r["ar_step_bytes"] / m["read_bytes_per_s"])
        assert r["ar_step_x_roofline"] == pytest.approx(r["ar_step_s"] / r["ar_step_roofline_s"])
        # the bandwidth read between the judged steps' reps (1 rep each: 3 samples), and the steps against it
        assert r["read_beside_bytes_per_s"] > 0 and r["read_beside_spread"] >= 1.0
        assert r["gemm_beside_flops_per_s"] > 0 and r["gemm_beside_spread"] >= 1.0  # and the GEMM rate
        for name in ("ar_step", "verify", "draft_step"):
            assert r[f"{name}_read_beside_bytes_per_s"] > 0 and r[f"{name}_x_roofline_beside"] > 0, name
            assert r[f"{name}_gemm_beside_flops_per_s"] > 0, name
    assert "read beside the steps GB/s" in printed and "GEMM beside the steps GFLOP/s" in printed
    assert steps[0]["prefill_s"] > 0 and steps[1]["prefill_s"] is None
    for r in result["rows"]:  # every row says where it ran and with which kernels
        assert r["cpu"] and "read_bytes_per_s" in r and "gemm_flops_per_s" in r and r["kernels"].startswith("linear ")
        assert r["kernels_source"] in ("measured", "cache", "default", "env")
    for r in steps:  # the decomposition: the parts alone, the rest is the difference
        for step in ("ar", "verify"):
            assert r[f"{step}_linears_s"] > 0 and r[f"{step}_attention_s"] > 0
            key = "ar_step_s" if step == "ar" else "verify_importance_s"
            assert r[f"{step}_rest_s"] == pytest.approx(r[key] - r[f"{step}_linears_s"] - r[f"{step}_attention_s"])
    assert result["meta"]["kernel_plan"]["linear"] and result["meta"]["isa"] is not None
    assert "kernels:" in printed and "AR linears / attention / rest ms" in printed
    with open_store(db, create=False) as store:
        stored = store.bench_rows()
        runs = store.runs()
    assert len(stored) == len(result["rows"])
    assert [(r["benchmark"], r["status"]) for r in runs] == [("bench", "finished")]


def test_profile_prints_the_op_table_of_one_step(capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="cluster.speed.measure")
    rc = bench.main(["--shape", "tiny", "--random-weights", "--context-lengths", "128", "--batch-sizes", "2",
                     "--k", "3", "--reps", "1", "--warmup", "0", "--gen-tokens", "6", "--db", "", "--threads", "1",
                     "--profile", "verify"])
    assert rc == 0
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "profile of the verify step" in logged and "Self CPU" in logged
    with pytest.raises(SystemExit):
        bench.parse_args(["--profile", "prefill"])


def test_the_e2e_part_is_a_speed_sweep_spec_per_batch_size(tmp_path):
    from cluster.sweep.plan import compute_run_id

    tiny = str(tiny_model_like(tmp_path / "tiny"))
    cfg = BenchConfig(model=tiny, context_lengths=(256, 512), batch_sizes=(1, 4), methods=("sparsespec-l",),
                      method_k=3, budget_frac=0.2, gen_tokens=6, e2e_reps=2, e2e_max_tokens=1024)
    db = f"sqlite:///{tmp_path}/x.db"
    specs = bench.e2e_specs(cfg, db, threads=1)
    assert [(s.batch_sizes, s.context_lengths) for s in specs] == [((1,), (256, 512)), ((4,), (256,))]  # 4 x 512 > 1024
    s = specs[0]
    assert s.methods == {"ar": {}, "sparsespec-l": {"k": 3, "budget_frac": 0.2}}
    assert [(b.name, b.num_samples) for b in s.benchmarks] == [("speed", 1)] and specs[1].benchmarks[0].num_samples == 4
    assert (s.sampling.max_new_tokens, s.sampling.temperature, s.repetitions, s.device, s.db) == (6, 0.0, 2, "cpu", db)
    from cluster.sweep.run import plan

    cells, shards = plan(s)
    assert [(c.context_length, c.batch_size, c.repetition) for c in cells] == [(256, 1, 0), (256, 1, 1),
                                                                             (512, 1, 0), (512, 1, 1)]
    assert all(c.run_id == compute_run_id("speed", c.config) for c in cells)
    assert [len(sh.samples[0].prompt_ids) for sh in shards] == [250, 250, 506, 506]
    # the same bench gives the same run ids (what makes a rerun resume)
    assert [c.run_id for c in plan(bench.e2e_specs(cfg, db, threads=1)[0])[0]] == [c.run_id for c in cells]
    # --quantize int8: the same sweep on the int8 target, its own runs
    q8 = bench.e2e_specs(dataclasses.replace(cfg, quantize="int8"), db, threads=1)[0]
    assert q8.quantize == ("int8",)
    cells8 = plan(q8)[0]
    assert all(c.quantize == "int8" for c in cells8) and not {c.run_id for c in cells8} & {c.run_id for c in cells}


def test_steps_on_an_int8_target_read_the_int8_weights(tmp_path):
    out = tmp_path / "b.json"
    args = ["--shape", "tiny", "--random-weights", "--context-lengths", "256", "--batch-sizes", "1", "--k", "3",
            "--reps", "1", "--warmup", "0", "--gen-tokens", "6", "--db", "", "--threads", "1"]
    assert bench.main(args + ["--json-out", str(out)]) == 0
    fp = json.loads(out.read_text())["rows"][0]
    assert bench.main(args + ["--json-out", str(out), "--quantize", "int8"]) == 0
    q8 = json.loads(out.read_text())
    r = q8["rows"][0]
    assert q8["meta"]["config"]["quantize"] == "int8"
    # every step's roofline reads the int8 weights: fewer bytes than the full-precision target's
    for step in ("ar_step", "verify", "draft_step"):
        assert r[f"{step}_bytes"] < fp[f"{step}_bytes"], step
    # an int8 target's "int8 draft" is its own forward: no extra copy
    assert r["draft_weight_int8_bytes"] == 0 and r["draft_step_int8_bytes"] == r["draft_step_bytes"]


def test_bench_rows_replace_on_rewrite_and_nan_becomes_null(tmp_path):
    with open_store(f"sqlite:///{tmp_path / 'b.db'}") as store:
        store.start_run("r", benchmark="bench", model="m", methods=["ar"], config={})
        row = {"kind": "steps", "context_len": 1, "batch_size": 1, "x": float("nan")}
        store.add_bench_rows("r", "m", "cpu", [row])
        store.add_bench_rows("r", "m", "cpu", [{**row, "x": 2.0}])
        rows = store.bench_rows("r")
    assert len(rows) == 1 and rows[0]["x"] == 2.0
    with open_store(f"sqlite:///{tmp_path / 'c.db'}") as store:
        store.start_run("r", benchmark="bench", model="m", methods=["ar"], config={})
        store.add_bench_rows("r", "m", "cpu", [{"kind": "steps", "context_len": 1, "batch_size": 1,
                                                "x": float("inf")}])
        assert store.bench_rows()[0]["x"] is None


def test_contexts_that_do_not_fit_the_window_fail_before_measuring():
    cfg = BenchConfig(shape="tiny", random_weights=True, context_lengths=(128, 4097), batch_sizes=(1,))
    with pytest.raises(ValueError, match=r"\[4097\].*longest that fits is 4096"):
        bench.run_bench(cfg, progress=lambda _: pytest.fail("measured before rejecting the context"))
    # the step timings' cache holds prompt + K + 2: a K beyond the generated tokens shortens it
    cfg = BenchConfig(shape="tiny", random_weights=True, context_lengths=(4096,), batch_sizes=(1,), k=70)
    with pytest.raises(ValueError, match="longest that fits is 4088"):
        bench.run_bench(cfg, progress=lambda _: pytest.fail("measured before rejecting the context"))


# --------------------------------------------------------------------------- end to end, on local Ray
TINY_ARGS = ["--context-lengths", "256", "--batch-sizes", "1,2", "--methods", "sparsespec-l,magicdec-streaming",
             "--k", "3", "--reps", "1", "--warmup", "0", "--gen-tokens", "6", "--e2e-reps", "1", "--peers", "transformers",
             "--peer-tokens", "4", "--peer-reps", "1", "--threads", "1", "--num-workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_bench(ray_session, tmp_path_factory):
    """One bench of a tiny real model folder (random weights, SmolLM2's tokenizer) end to end."""
    tmp = tmp_path_factory.mktemp("bench")
    model = str(tiny_model_like(tmp / "tiny-llama"))
    db = f"sqlite:///{tmp / 'b.db'}"
    args = ["--model", model, *TINY_ARGS, "--db", db]
    rc = bench.main([*args, "--json-out", str(tmp / "first.json"), "--markdown-out", str(tmp / "first.md")])
    return {"rc": rc, "args": args, "db": db, "tmp": tmp, "result": json.loads((tmp / "first.json").read_text()),
            "md": (tmp / "first.md").read_text()}


def _e2e(result):
    return {(r["context_len"], r["batch_size"], r["method"]): r for r in result["rows"] if r["kind"] == "e2e"}


def _results(db):
    with open_store(db, create=False) as st:
        return st.results()


@pytest.mark.slow
def test_tiny_bench_times_the_steps_and_runs_the_e2e_part_as_a_sweep(tiny_bench):
    assert tiny_bench["rc"] == 0
    result, db = tiny_bench["result"], tiny_bench["db"]
    steps = [r for r in result["rows"] if r["kind"] == "steps"]
    assert [(r["context_len"], r["prompt_len"], r["batch_size"]) for r in steps] == [(256, 250, 1), (256, 250, 2)]
    e2e = _e2e(result)
    assert set(e2e) == {(256, b, m) for b in (1, 2) for m in ("ar", "sparsespec-l", "magicdec-streaming")}
    for (_, B, m), r in e2e.items():
        assert r["n"] == B and r["num_batches"] == 1 and r["decode_tokens_per_s"] > 0
        if m == "ar":
            assert r["speedup"] == 1.0 and r["lossless"] is None
        else:
            assert r["lossless"] is True and r["lossless_rate"] == 1.0  # fp32 greedy: token-identical to ar
            assert r["alpha"] is not None and r["tau"] >= 1.0 and r["ledger_speedup"] > 0
            assert r["speedup"] > 0 and r["speedup_runs"] == [pytest.approx(r["speedup"])]
            assert r["roofline_speedup"] > 0 and r["step_predicted_speedup"] > 0
            assert r["cycle_predicted_speedup"] > 0
            assert r["straggle"] > 0 and (B > 1 or r["straggle"] == 1.0)  # a batch of one keeps it all
    peers = {(r["method"], r["batch_size"]): r for r in result["rows"] if r["kind"] == "peer"}
    assert {m for m, _ in peers} == {"sparsespec:ar", "sparsespec:ngram", "transformers:ar", "transformers:prompt-lookup"}
    assert peers[("sparsespec:ar", 1)]["same_tokens_as_ours"] is True
    assert "batch size 1 only" in peers[("transformers:prompt-lookup", 2)]["error"]
    assert peers[("transformers:prompt-lookup", 1)]["decode_ms_per_step"] > 0
    for (_, B, m), r in e2e.items():
        if m != "ar":  # the physics columns: measured vs the roofline at the measured alpha and mean k
            assert r["measured_over_roofline"] == pytest.approx(r["speedup"] / r["roofline_speedup"])
            assert 0 <= r["roofline_best_k"] <= 16 and r["roofline_best_speedup"] >= 1.0
    assert "peers: the same prompts" in tiny_bench["md"] and "measured / roofline" in tiny_bench["md"]
    info = result["meta"]["e2e"]
    assert len(info["run_ids"]) == 2 and info["shards"] == info["done"] == 2 and not info["failed"]
    assert all(rid.startswith("speed-") for rid in info["run_ids"])
    # the sweep's results: every sample x method once, each generating exactly --gen-tokens
    results = _results(db)
    assert len(results) == (1 + 2) * 3
    assert all(len(r["token_ids"]) == 6 and r["score"] is None for r in results)
    with open_store(db, create=False) as st:
        runs = {r["run_id"]: r for r in st.runs()}
        assert len(st.bench_rows()) == len(result["rows"])
    assert {runs[rid]["status"] for rid in info["run_ids"]} == {"finished"}
    assert [r["benchmark"] for r in runs.values()].count("bench") == 1
    assert "end to end: sweep of the `speed` benchmark" in tiny_bench["md"] and "| ctx | B | method |" in tiny_bench["md"]


@pytest.mark.slow
def test_the_bench_e2e_rows_are_the_report_of_its_sweep_runs(tiny_bench):
    result, db = tiny_bench["result"], tiny_bench["db"]
    rep = report_rows(db, result["meta"]["e2e"]["run_ids"])
    assert rep and all(r["benchmark"] == "speed" and r["task"] == "fixed" for r in rep)
    e2e = _e2e(result)
    assert set(e2e) == {(r["context_length"], r["batch_size"], r["method"]) for r in rep}
    for r in rep:
        mine = e2e[(r["context_length"], r["batch_size"], r["method"])]
        for key in ("n", "speedup", "alpha", "tau", "mean_k", "gamma", "lossless_rate"):
            assert mine[key] == r[key], key


@pytest.mark.slow
def test_rerunning_the_same_bench_resumes_and_writes_nothing_twice(tiny_bench):
    db, tmp = tiny_bench["db"], tiny_bench["tmp"]
    before = _results(db)
    assert bench.main([*tiny_bench["args"], "--json-out", str(tmp / "again.json")]) == 0
    again = json.loads((tmp / "again.json").read_text())
    info = again["meta"]["e2e"]
    assert info["run_ids"] == tiny_bench["result"]["meta"]["e2e"]["run_ids"]
    assert info["done"] == 0 and info["skipped"] == info["shards"] == 2
    after = _results(db)
    keys = [(r["run_id"], r["task"], r["sample_id"], r["method"]) for r in after]
    assert len(after) == len(before) == len(set(keys))
    first = _e2e(tiny_bench["result"])
    for key, r in _e2e(again).items():
        assert (r["speedup"], r["lossless_rate"], r["alpha"]) == (first[key]["speedup"], first[key]["lossless_rate"],
                                                                  first[key]["alpha"])


@pytest.mark.slow
def test_real_model_with_transformers_peer(tmp_path, monkeypatch):
    """SmolLM2 at a short context: transformers' generate and prompt lookup on the same prompt give
    our AR's greedy tokens (fp32), and so does our ngram; a missing vLLM venv is a row saying why.
    Steps only: the end-to-end part on Ray is the tiny bench's (and a real model's sweep is
    tests/test_cluster_e2e.py's)."""
    monkeypatch.setenv("SPARSESPEC_PEERS_VENV", str(tmp_path / "no-peers-venv"))
    cfg = BenchConfig(context_lengths=(256,), batch_sizes=(1,), reps=1, warmup=0, gen_tokens=8, steps_only=True,
                      peer_tokens=16, peer_reps=1, k=4, method_k=4)
    torch.set_num_threads(2)
    result = bench.run_bench(cfg, progress=lambda _: None, threads=2)
    assert result["meta"]["e2e"] is None and [r["kind"] for r in result["rows"]].count("steps") == 1
    peers = {r["method"]: r for r in result["rows"] if r["kind"] == "peer"}
    for m in ("sparsespec:ar", "sparsespec:ngram", "transformers:ar", "transformers:prompt-lookup"):
        assert peers[m]["same_tokens_as_ours"] is True and peers[m]["decode_ms_per_step"] > 0, m
    for m in ("vllm:ar", "vllm:ngram"):  # without `make peers`: a row that says so
        assert "make peers" in peers[m]["error"] and "decode_ms_per_step" not in peers[m]


@pytest.mark.slow
def test_ray_fan_out_merges_context_lengths_in_order(ray_session, tmp_path):
    cfg = BenchConfig(shape="tiny", random_weights=True, context_lengths=(128, 192), batch_sizes=(1,),
                      methods=("sparsespec-l",), k=2, method_k=2, reps=1, warmup=0, gen_tokens=4, e2e_reps=1)
    result = bench.run_bench_ray(cfg, threads=1)
    steps = [r for r in result["rows"] if r["kind"] == "steps"]
    assert [r["context_len"] for r in steps] == [128, 192]
    assert all(r["machine"]["read_bytes_per_s"] > 0 for r in result["rows"])
    assert result["meta"]["config"]["context_lengths"] == (128, 192)
    assert result["meta"]["ray_workers"] == 1 and result["meta"]["e2e"] is None
