"""cluster.bench: roofline arithmetic, flag validation, and a tiny run through every measurement."""
from __future__ import annotations

import json
import math

import pytest
import torch

from cluster import bench
from cluster.bench import BenchConfig, kv_bytes, roofline, step_flops, weight_bytes
from cluster.store import open_store
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


def test_roofline_is_the_larger_of_the_memory_and_compute_floors():
    tiny = random_transformer("tiny")
    machine = {"read_bytes_per_s": 1e9, "gemm_flops_per_s": 1e12}
    r = roofline(tiny, machine, batch=2, tokens=1, kv_positions=1000)
    assert r["bytes"] == weight_bytes(tiny) + kv_bytes(tiny.cfg, 4, 2, 1000)
    assert math.isclose(r["mem_s"], r["bytes"] / 1e9)
    assert r["roofline_s"] == max(r["mem_s"], r["compute_s"])
    slow_compute = roofline(tiny, {"read_bytes_per_s": 1e12, "gemm_flops_per_s": 1e6}, 2, 1, 1000)
    assert slow_compute["roofline_s"] == slow_compute["compute_s"] > slow_compute["mem_s"]


@pytest.mark.parametrize("kwargs, msg", [
    ({"random_weights": True}, "needs --shape"),
    ({"context_lengths": (32,)}, "context lengths"),
    ({"batch_sizes": (0,)}, "batch sizes"),
    ({"k": 0}, "k must be"),
    ({"budget_frac": 0.0}, "budget_frac"),
    ({"gen_tokens": 1}, "gen_tokens"),
    ({"device": "tpu"}, "device"),
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


def test_tiny_run_measures_every_step_and_stores_it(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    out = tmp_path / "bench.json"
    rc = bench.main(["--shape", "tiny", "--random-weights", "--context-lengths", "256", "--batch-sizes", "1,2",
                     "--methods", "sparsespec-l,magicdec-streaming", "--k", "3", "--reps", "1", "--warmup", "0",
                     "--gen-tokens", "6", "--e2e-reps", "1", "--db", db, "--json-out", str(out), "--threads", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| ctx | B |" in printed and "stored as run bench-" in printed
    result = json.loads(out.read_text())
    assert result["machine"]["read_bytes_per_s"] > 0 and result["machine"]["gemm_flops_per_s"] > 0
    steps = [r for r in result["rows"] if r["kind"] == "steps"]
    assert [(r["context_len"], r["batch_size"]) for r in steps] == [(256, 1), (256, 2)]
    for r in steps:
        for key in ("ar_step_s", "verify_s", "verify_importance_s", "draft_step_s", "gather_s",
                    "index_update_s", "index_rebuild_s"):
            assert r[key] > 0, key
        assert r["n_index"] == 128  # 10 % of 256 is under the 128-token floor
        assert r["ar_step_x_roofline"] > 0 and r["gamma_roofline"] > 0
        # the draft reads the index, the verify the whole context: the roofline says drafting is cheaper
        assert r["draft_step_bytes"] < r["verify_bytes"]
    assert steps[0]["prefill_s"] > 0 and steps[1]["prefill_s"] is None
    e2e = [r for r in result["rows"] if r["kind"] == "e2e"]
    assert {(r["batch_size"], r["method"]) for r in e2e} == {(b, m) for b in (1, 2)
                                                            for m in ("ar", "sparsespec-l", "magicdec-streaming")}
    for r in e2e:
        if r["method"] == "ar":
            assert r["speedup"] == 1.0
        else:
            assert r["lossless"] is True  # fp32 greedy: token-identical to ar
            assert r["alpha"] is not None and r["tau"] >= 1.0 and r["ledger_speedup"] > 0
    with open_store(db, create=False) as store:
        stored = store.bench_rows()
        runs = store.runs()
    assert len(stored) == len(result["rows"])
    assert runs[0]["benchmark"] == "bench" and runs[0]["status"] == "finished"


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


@pytest.mark.slow
def test_real_model_with_transformers_reference(tmp_path):
    """SmolLM2 at a short context: the transformers reference runs on the same prompt and the
    greedy tokens of our AR match transformers' (fp32)."""
    cfg = BenchConfig(context_lengths=(256,), batch_sizes=(1,), reps=1, warmup=0, gen_tokens=8, e2e_reps=1,
                      hf_tokens=8, k=4, method_k=4)
    torch.set_num_threads(2)
    result = bench.run_bench(cfg, progress=lambda _: None)
    hf = next(r for r in result["rows"] if r["kind"] == "hf")
    ar = next(r for r in result["rows"] if r["kind"] == "e2e" and r["method"] == "ar")
    assert hf["hf_step_s"] > 0 and ar["hf_over_ar_tpot"] > 0
    assert ar["hf_same_tokens"] is True  # same greedy tokens as transformers on the same prompt
    steps = next(r for r in result["rows"] if r["kind"] == "steps")
    assert steps["hf_over_ar_step"] > 0


@pytest.mark.slow
def test_ray_fan_out_merges_context_lengths_in_order(ray_session, tmp_path):
    cfg = BenchConfig(shape="tiny", random_weights=True, context_lengths=(128, 192), batch_sizes=(1,),
                      methods=("sparsespec-l",), k=2, method_k=2, reps=1, warmup=0, gen_tokens=4, e2e_reps=1)
    result = bench.run_bench_ray(cfg, threads=1)
    steps = [r for r in result["rows"] if r["kind"] == "steps"]
    assert [r["context_len"] for r in steps] == [128, 192]
    assert all(r["machine"]["read_bytes_per_s"] > 0 for r in result["rows"])
    assert result["meta"]["config"]["context_lengths"] == (128, 192)


def test_contexts_that_do_not_fit_the_window_fail_before_measuring():
    cfg = BenchConfig(shape="tiny", random_weights=True, context_lengths=(128, 4090), batch_sizes=(1,))
    with pytest.raises(ValueError, match=r"\[4090\].*longest that fits is 4022"):
        bench.run_bench(cfg, progress=lambda _: pytest.fail("measured before rejecting the context"))
