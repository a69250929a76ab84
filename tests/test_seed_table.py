"""The seed's table in kind (issue 28 item 3): method variants in one spec, methods that cannot
run on a target recorded as rows that say why, and ``report --seed-table`` with the ledger and
roofline S beside the seed's figures.

Units (synthetic rows, analytic values) and one sweep on local Ray with a random-weight tiny
Llama (``helpers.tiny_model_like``): ``eagle3`` has no head for it, so the sweep must record it
as unavailable and still run the rest.
"""
from __future__ import annotations

import json
import math

import pytest

from cluster.results import report
from cluster.results.aggregate import UNAVAILABLE_EVENT, unavailable_methods
from cluster.results.seed_table import (SEED, SEED_METHODS, SEED_TABLE_KEYS, cell_roofline_s, format_seed_table,
                                        seed_table)
from cluster.sweep import run as sweep
from cluster.sweep.coordinator import result_rows
from cluster.sweep.plan import plan_cells, plan_shards
from cluster.sweep.schema import SpecError, check_method_sets, parse_spec
from cluster.sweep.worker import EngineWorker
from helpers import tiny_model_like
from sparsespec.registry import MethodUnavailable
from sparsespec.roofline import geometry, geometry_roofline, roofline, roofline_speedup


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_like(tmp_path_factory.mktemp("m") / "tiny-llama"))


def _spec(tiny, db, methods, **kw):
    data = {
        "name": "seed", "models": [tiny], "methods": methods, "batch_sizes": [2],
        "benchmarks": [{"name": "ruler", "tasks": ["niah_single_1"], "num_samples": 2, "context_lengths": [512]}],
        "sampling": {"max_new_tokens": 6}, "workers": {"num_workers": 1, "threads": 1, "max_retries": 0},
        "db": db,
    }
    data.update(kw)
    return parse_spec(data)


def _info(model):
    from sparsespec import load_tokenizer, model_max_context

    return load_tokenizer(model), model_max_context(model)


# --------------------------------------------------------------------------- variants in one spec
def test_a_list_of_option_sets_makes_one_run_per_further_variant(tiny, tmp_path):
    spec = _spec(tiny, "sqlite:///x.db", {"ngram": {}, "sparsespec-l": [{"k": "auto"}, {"k": 4}, {"k": 2}]})
    assert spec.methods["sparsespec-l"] == {"k": "auto"}
    assert spec.method_variants == {"sparsespec-l": ({"k": 4}, {"k": 2})}
    sets = check_method_sets(spec)
    assert [list(s) for s in sets] == [["ar", "ngram", "sparsespec-l"], ["ar", "sparsespec-l"], ["ar", "sparsespec-l"]]
    assert [s["sparsespec-l"]["k"] for s in sets] == ["auto", 4, 2]
    cells = plan_cells(spec, sets, _info)
    assert len(cells) == 3 and len({c.run_id for c in cells}) == 3
    assert [c.config["methods"] for c in cells] == [list(s) for s in sets]
    assert [c.config["method_options"]["sparsespec-l"]["k"] for c in cells] == ["auto", 4, 2]
    # the first set's run is the run the spec without variants makes (ids do not move)
    plain = _spec(tiny, "sqlite:///x.db", {"ngram": {}, "sparsespec-l": {"k": "auto"}})
    assert plan_cells(plain, check_method_sets(plain), _info)[0].run_id == cells[0].run_id
    assert [sh.methods for sh in plan_shards(cells[1])] == [("ar", "sparsespec-l")]


@pytest.mark.parametrize("methods, needle", [
    ({"sparsespec-l": []}, "empty list"),
    ({"ar": [{}, {}]}, "'ar' takes no options"),
    ({"sparsespec-l": [{"k": 2}, 3]}, "must be mappings"),
])
def test_bad_variant_lists_are_spec_errors(tiny, methods, needle):
    with pytest.raises(SpecError, match=needle):
        _spec(tiny, "sqlite:///x.db", methods)


def test_a_variant_listed_twice_or_invalid_is_refused(tiny):
    with pytest.raises(SpecError, match="twice"):
        check_method_sets(_spec(tiny, "sqlite:///x.db", {"sparsespec-l": [{"k": 2}, {"k": 2}]}))
    with pytest.raises(SpecError, match="twice"):  # the default k resolves to the listed one
        check_method_sets(_spec(tiny, "sqlite:///x.db", {"sparsespec-l": [{}, {"k": "auto"}]}))
    with pytest.raises(SpecError):
        check_method_sets(_spec(tiny, "sqlite:///x.db", {"sparsespec-l": [{"k": 2}, {"k": -1}]}))
    with pytest.raises(SpecError, match="method_variants"):
        parse_spec({"name": "x", "models": [tiny], "benchmarks": ["ruler"], "methods": {"ngram": [{}, {"n": 2}]},
                    "method_variants": {"ngram": [{}]}})
    # the resolved spec stored with a run reads back to the same spec
    spec = _spec(tiny, "sqlite:///x.db", {"sparsespec-l": [{"k": "auto"}, {"k": 4}]})
    assert parse_spec(spec.resolved()) == spec


# --------------------------------------------------------------------------- unavailable methods
def test_the_worker_leaves_out_an_unavailable_method_and_says_why(tiny, tmp_path):
    spec = _spec(tiny, "sqlite:///x.db", {"eagle3": {}, "sparsespec-l": {"k": 2}})
    (cell,) = plan_cells(spec, check_method_sets(spec), _info)
    (shard,) = plan_shards(cell)
    worker = EngineWorker(tiny, threads=1)
    out = worker.run_shard(shard)
    assert set(out["unavailable"]) == {"eagle3"}
    assert "no EAGLE-3 head" in out["unavailable"]["eagle3"] and "train_eagle3" in out["unavailable"]["eagle3"]
    assert sorted({r["method"] for r in out["rows"]}) == ["ar", "sparsespec-l"]
    rows = result_rows(shard, out["rows"], lambda s, t: 0.0, out["unavailable"])
    assert len(rows) == 2 * len(shard.samples)
    # the reason is remembered: a second shard does not try the head again
    again = worker.run_shard(shard)
    assert again["unavailable"] == out["unavailable"]
    ping = worker.ping()
    assert ping["geometry"] == geometry(worker.engine.model)
    assert ping["machine"]["read_bytes_per_s"] > 0 and ping["machine"]["gemm_flops_per_s"] > 0


def test_only_method_unavailable_is_skipped(tiny, monkeypatch):
    spec = _spec(tiny, "sqlite:///x.db", {"sparsespec-l": {"k": 2}})
    (cell,) = plan_cells(spec, check_method_sets(spec), _info)
    (shard,) = plan_shards(cell)
    worker = EngineWorker(tiny, threads=1)
    real = worker.engine.core

    def broken(method, *a, **kw):
        if method == "sparsespec-l":
            raise ValueError("a bug, not a missing head")
        return real(method, *a, **kw)

    monkeypatch.setattr(worker.engine, "core", broken)
    with pytest.raises(ValueError, match="a bug"):
        worker.run_shard(shard)

    def no_ar(method, *a, **kw):
        raise MethodUnavailable("the reference itself")

    monkeypatch.setattr(worker.engine, "core", no_ar)
    with pytest.raises(MethodUnavailable):
        EngineWorker(tiny, threads=1, engine_factory=lambda *a: worker.engine).run_shard(shard)


def test_result_rows_refuses_an_unavailable_ar_or_a_stranger(tiny):
    spec = _spec(tiny, "sqlite:///x.db", {"sparsespec-l": {"k": 2}})
    (cell,) = plan_cells(spec, check_method_sets(spec), _info)
    (shard,) = plan_shards(cell)
    with pytest.raises(ValueError, match="ar must run"):
        result_rows(shard, [], lambda s, t: 0.0, {"ar": "x"})
    with pytest.raises(ValueError, match="ar must run"):
        result_rows(shard, [], lambda s, t: 0.0, {"eagle3": "x"})
    with pytest.raises(ValueError, match="missing"):  # sparsespec-l was not reported unavailable
        result_rows(shard, [], lambda s, t: 0.0)


def test_unavailable_methods_reads_the_latest_reason_per_model_and_method():
    runs = [
        {"run_id": "b", "model": "m", "created_at": "2026-01-02", "events": [
            {"message": f"{UNAVAILABLE_EVENT}: eagle3: newer", "method": "eagle3", "unavailable": "newer"}]},
        {"run_id": "a", "model": "m", "created_at": "2026-01-01", "events": [
            {"message": f"{UNAVAILABLE_EVENT}: eagle3: older", "method": "eagle3", "unavailable": "older"},
            {"message": "worker died", "shard": "x"}]},
        {"run_id": "c", "model": "n", "created_at": "2026-01-03", "events": None},
    ]
    assert unavailable_methods(runs) == {("m", "eagle3"): "newer"}


# --------------------------------------------------------------------------- roofline S
def test_roofline_speedup_counts_non_drafting_steps_as_ar_steps():
    # every step drafts: tau * ar / (k * draft + verify)
    assert roofline_speedup(3.0, 4.0, 1.0, 0.1, 1.2) == pytest.approx(3.0 / 1.6)
    # half the steps draft nothing (cost one AR step each)
    assert roofline_speedup(2.0, 4.0, 1.0, 0.1, 1.2, 0.5) == pytest.approx(2.0 / (0.5 * 1.6 + 0.5 * 1.0))
    assert roofline_speedup(1.0, 0.0, 1.0, 0.1, 1.2, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="drafting_frac"):
        roofline_speedup(1.0, 1.0, 1.0, 0.1, 1.2, 1.5)


def test_geometry_roofline_equals_the_model_roofline(tiny):
    from sparsespec.model import Transformer

    m = Transformer.from_folder(tiny)
    machine = {"read_bytes_per_s": 1e10, "gemm_flops_per_s": 3e10}
    g = geometry(m)
    json.dumps(g)  # plain numbers: stored with the run
    for batch, tokens, pos, keys in [(1, 1, 100, None), (4, 9, 5000, None), (2, 1, 800, 64)]:
        assert geometry_roofline(g, machine, batch, tokens, pos, keys) == roofline(m, machine, batch, tokens, pos, keys)


GEOM = {"weight_bytes": 1_000_000, "linear_params": 250_000, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "element_size": 4}
MACHINE = {"read_bytes_per_s": 1e9, "gemm_flops_per_s": 1e10}


def _stats(steps, drafting, drafted, accepted, emitted, out_tokens, budget=None, ctx=None, **kw):
    st = {"num_steps": steps, "num_drafting_steps": drafting, "num_drafted": drafted, "num_accepted": accepted,
          "num_emitted": emitted, "num_output_tokens": out_tokens, "num_draft_forwards": drafted,
          "draft_s": 0.01 * drafted, "verify_s": 0.1 * steps, "decode_s": 0.1 * steps + 0.01 * drafted,
          "total_s": 1.0, "prefill_s": 0.5}
    if budget is not None:
        st.update(budget_tokens_sum=budget, context_tokens_sum=ctx)
    st.update(kw)
    return st


def test_cell_roofline_s_from_the_stored_floors():
    rows = [{"run_id": "r", "num_input_tokens": 1000,
             "stats": _stats(10, 8, 32, 24, 34, 34, budget=200, ctx=1000)}]
    inputs = {"r": (MACHINE, GEOM)}
    ctx = 1000 + 0.5 * 34
    ar = geometry_roofline(GEOM, MACHINE, 2, 1, ctx)["roofline_s"]
    verify = geometry_roofline(GEOM, MACHINE, 2, 32 / 8 + 1, ctx)["roofline_s"]
    draft = geometry_roofline(GEOM, MACHINE, 2, 1, 0.2 * ctx)["roofline_s"]
    want = 3.4 * ar / (0.8 * (4 * draft + verify) + 0.2 * ar)
    assert cell_roofline_s("sparsespec-l", rows, 2, inputs) == pytest.approx(want)
    assert cell_roofline_s("ngram", rows, 2, inputs) == pytest.approx(3.4 * ar / (0.8 * verify + 0.2 * ar))
    assert cell_roofline_s("draft-model", rows, 2, inputs) is None  # the draft's weights are not stored
    assert cell_roofline_s("sparsespec-l", rows, 2, {}) is None  # no machine / geometry
    assert cell_roofline_s("ar", rows, 2, {}) == 1.0


def _row(run, method, k, sample, batch="r/t/0", **st):
    stats = {**st, "batch_key": batch, "batch_wall_s": st.pop("_wall", 1.0), "batch_prefill_s": 0.0,
             "batch_size": 1, "k": k}
    return {"run_id": run, "benchmark": "b", "task": "t", "model": "m", "method": method, "sample_id": sample,
            "score": 1.0, "stats": stats, "lossless": None if method == "ar" else True,
            "num_input_tokens": 1000, "batch_size": 1, "context_length": 1024, "quantize": "none"}


def test_seed_table_rows_every_seed_method_in_order_and_says_why_one_is_missing():
    rows = []
    for i in range(5):
        b = f"b{i}"
        rows.append(_row("r1", "ar", None, f"s{i}", batch=b, _wall=2.0, **_stats(20, 0, 0, 0, 20, 20)))
        rows.append(_row("r1", "sparsespec-l", "auto", f"s{i}", batch=b, _wall=1.0,
                         **_stats(8, 8, 32, 12, 20, 20, budget=200, ctx=1000)))
        rows.append(_row("r2", "ar", None, f"s{i}", batch="x" + b, _wall=2.0, **_stats(20, 0, 0, 0, 20, 20)))
        rows.append(_row("r2", "sparsespec-l", 4, f"s{i}", batch="x" + b, _wall=1.6,
                         **_stats(8, 8, 32, 12, 20, 20, budget=200, ctx=1000)))
    runs = [{"run_id": "r1", "model": "m", "created_at": "1", "events": [
                {"message": f"{UNAVAILABLE_EVENT}: eagle3: no head", "method": "eagle3", "unavailable": "no head"}],
             "host": {"workers": [{"pid": 1}, {"machine": MACHINE, "geometry": GEOM}]}},
            {"run_id": "r2", "model": "m", "created_at": "2", "events": [],
             "host": {"workers": [{"machine": MACHINE, "geometry": GEOM}]}}]
    table = seed_table(rows, runs)
    assert all(set(r) == set(SEED_TABLE_KEYS) for r in table)
    labels = [(r["method"], r["k"], r["status"]) for r in table]
    assert labels == [("ar", None, "ok"), ("draft-model", None, "not run"), ("magicdec-snapkv", None, "not run"),
                      ("eagle3", None, "unavailable"), ("sparsespec-l", "auto", "ok"), ("sparsespec-l", 4, "ok")]
    by = {(r["method"], r["k"]): r for r in table}
    assert by[("eagle3", None)]["note"] == "no head"
    assert by[("sparsespec-l", "auto")]["speedup"] == pytest.approx(2.0)
    assert by[("sparsespec-l", 4)]["speedup"] == pytest.approx(1.25)
    assert by[("sparsespec-l", 4)]["alpha"] == pytest.approx(12 / 32)
    assert by[("sparsespec-l", 4)]["mean_k"] == pytest.approx(4.0)
    assert by[("sparsespec-l", "auto")]["seed_speedup"] == SEED["sparsespec-l"][0]
    assert by[("ar", None)]["roofline_s"] == 1.0 and by[("ar", None)]["speedup"] == 1.0
    assert by[("sparsespec-l", 4)]["roofline_s"] == pytest.approx(
        cell_roofline_s("sparsespec-l", [r for r in rows if r["run_id"] == "r2" and r["method"] != "ar"], 1,
                        {"r2": (MACHINE, GEOM)}))
    text = format_seed_table(table)
    assert "## m, context 1024, batch 1" in text and "sparsespec-l (k auto)" in text and "sparsespec-l k=4" in text
    assert "unavailable" in text and "no head" in text and "2.79x / 0.729 / 11.26" in text
    assert [m for m in SEED_METHODS] == ["ar", "draft-model", "magicdec-snapkv", "eagle3", "sparsespec-l"]


# --------------------------------------------------------------------------- end to end on local Ray
@pytest.mark.usefixtures("ray_session")
def test_a_sweep_records_the_unavailable_method_and_the_report_prints_the_table(tiny, tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/seed.db"
    spec = _spec(tiny, db, {"eagle3": {}, "sparsespec-l": [{"k": 3}, {"k": "auto"}]}, batch_sizes=[1])
    res = sweep.run_sweep(spec, progress=False)
    assert not res.failed and len(res.run_ids) == 2
    rows = report.seed_table_rows(db)
    got = {(r["method"], r["k"]): r for r in rows}
    assert got[("eagle3", None)]["status"] == "unavailable" and "no EAGLE-3 head" in got[("eagle3", None)]["note"]
    for k in (3, "auto"):
        r = got[("sparsespec-l", k)]
        assert r["status"] == "ok" and r["n"] == 2 and r["n_pairs"] == 2 and r["lossless_rate"] in (1.0, None)
        assert r["roofline_s"] is not None and math.isfinite(r["roofline_s"]) and r["roofline_s"] > 0
    # the event is written once per run, not once per shard (two shards of batch 1)
    from cluster.results.store import open_store

    with open_store(db, create=False) as store:
        evs = [e for run in store.runs() for e in run["events"] if e.get("method") == "eagle3"]
    assert len(evs) == 1
    assert report.main(["--seed-table", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "eagle3" in out and "unavailable" in out and "roofline S" in out
    assert report.main(["--seed-table", "--db", db, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == len(rows)
    with pytest.raises(SystemExit):
        report.main(["--seed-table", "--policy", "--db", db])
