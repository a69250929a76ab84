"""Per-method options (issue 26 item 3): each drafter's own options dataclass, run ids that hash
only each method's own resolved options, and revision 0003, which moves the runs of a store
written before (ids from one shared 14-field ``SpecConfig``) to their new ids so a sweep resumes."""
from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
from sqlalchemy import inspect, select

import sparsespec
from cluster.sweep.plan import compute_run_id, plan_cells, plan_shards
from cluster.sweep.schema import check_methods, parse_spec
from cluster.results.store import RunIdMap, Store, alembic_config, current_revision, head_revision, open_store
from sparsespec import options_class, parse_method_options, resolve_method_options
from sparsespec.config import MethodOptions, SpecOptions, later_option
from sparsespec.registry import DRAFTERS
from tests.test_cluster_migrations import _engine, db_url  # noqa: F401  (db_url: SQLite, and PostgreSQL when set)

MIGRATION = importlib.import_module("cluster.results.migrations.versions.0003_per_method_run_ids")

#: ``SpecConfig`` as it was before per-method options (frozen here: the old run ids' form)
OLD_DEFAULTS = dict(k="auto", max_k=16, budget_frac=0.1, min_budget=128, max_budget=8192, n_sink=4, n_recent=32,
                    window=16, pool_kernel=7, draft_model=None, ngram_min=1, ngram_max=4, draft_weights="target",
                    controller="cost")


def old_resolve(method: str, options: dict) -> dict:
    """``resolve_method_options`` before this change: all 14 fields, ``controller`` left out for a
    fixed k, ``draft_weights`` left out at ``"target"`` (its LATER_OPTION_DEFAULTS)."""
    if method == "ar":
        return {}
    out = {**OLD_DEFAULTS, **options}
    if out["k"] != "auto":
        out.pop("controller")
    if out["draft_weights"] == "target":
        out.pop("draft_weights")
    return out


class CharTokenizer:
    """One token per character (ids = code points)."""

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return {"input_ids": ([1] + ids) if add_special_tokens else ids}


def _info(model):
    return CharTokenizer(), 4096


METHODS = {"sparsespec-l": {"k": 4}, "magicdec-snapkv": {"k": "auto", "window": 8},
           "ngram": {"k": 3, "ngram_max": 3}, "draft-model": {"draft_model": "smollm2-135m", "k": 2}}
CASES = [(m, o) for m, o in METHODS.items()] + [
    ("sparsespec-l", {}), ("sparsespec-l", {"draft_weights": "int8", "k": "auto", "controller": "entropy"}),
    ("magicdec-streaming", {"n_sink": 8, "budget_frac": 0.2}), ("eagle3", {}), ("eagle3", {"draft_model": "h"}),
    ("ngram", {"k": "auto", "max_k": 8}), ("ar", {})]


def _spec(methods, tmp_path, **kw):
    return parse_spec({"name": "t", "models": ["m"], "methods": methods, "batch_sizes": [2], "context_lengths": [200],
                       "benchmarks": [{"name": "speed", "num_samples": 3}], "sampling": {"max_new_tokens": 8},
                       "db": f"sqlite:///{tmp_path}/x.db", **kw})


def _ids(methods, tmp_path):
    spec = _spec(methods, tmp_path)
    return [c.run_id for c in plan_cells(spec, check_methods(spec), _info)]


# ------------------------------------------------------------------ the options dataclasses
def test_each_method_resolves_only_its_own_options():
    assert resolve_method_options("ar", None) == {} and options_class("ar") is MethodOptions
    own = {m: set(resolve_method_options(m, {"draft_model": "x"} if m == "draft-model" else {}))
           for m in sparsespec.METHODS}
    common = {"k", "max_k", "controller"}
    assert own["ngram"] == common | {"ngram_min", "ngram_max"}
    assert own["draft-model"] == own["eagle3"] == common | {"draft_model"}
    budget = common | {"budget_frac", "min_budget", "max_budget", "draft_weights"}
    assert own["sparsespec-l"] == budget | {"n_sink", "n_recent", "window"}
    assert own["magicdec-streaming"] == budget | {"n_sink"}
    assert own["magicdec-snapkv"] == budget | {"window", "pool_kernel"}
    for m in sparsespec.METHODS:  # each drafter declares a frozen options dataclass in its own file
        cls = options_class(m)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        assert m == "ar" or (issubclass(cls, SpecOptions) and cls.__module__ == DRAFTERS.get(m).__module__)
    # the controller only picks k="auto"'s lengths: not part of a fixed-k run
    assert "controller" not in resolve_method_options("ngram", {"k": 2})
    opts = parse_method_options("sparsespec-l", {"k": 4})
    assert opts.k_limit == 4 and opts.budget(10_000) == 1000 and parse_method_options("ngram", {}).k_limit == 16


@pytest.mark.parametrize("method, options, match", [
    ("sparsespec-l", {"kk": 1}, r"unknown method_options \['kk'\] for method 'sparsespec-l' \(did you mean 'k'\?\); "
                                r"its options: k, max_k, controller, budget_frac, .*window"),
    ("ngram", {"budget_frac": 0.2}, r"unknown method_options \['budget_frac'\] for method 'ngram'; its options: "
                                    r"k, max_k, controller, ngram_min, ngram_max$"),
    ("ngram", {"draft_weights": "int8"}, r"unknown method_options \['draft_weights'\] for method 'ngram'"),
    ("magicdec-streaming", {"window": 8}, r"for method 'magicdec-streaming'.*its options: .*n_sink$"),
    ("ar", {"k": 2}, r"unknown method_options \['k'\] for method 'ar'; it takes no options"),
    ("sparsespec-l", {"budget_frac": 1.5}, r"method 'sparsespec-l': budget_frac must be in \(0, 1\], got 1.5"),
    ("sparsespec-l", {"min_budget": 10}, r"method 'sparsespec-l': min_budget \(10\) must be >= n_sink \+ n_recent"),
    ("magicdec-snapkv", {"pool_kernel": 4}, r"method 'magicdec-snapkv': pool_kernel must be a positive odd"),
    ("ngram", {"ngram_min": 3, "ngram_max": 2}, r"method 'ngram': need 1 <= ngram_min <= ngram_max"),
    ("ngram", {"k": 0}, r"method 'ngram': k must be an integer >= 1 or 'auto', got 0"),
    ("eagle3", {"max_k": True}, r"method 'eagle3': max_k must be an integer >= 1"),
    ("draft-model", {"k": 2}, r"draft-model needs method_options=\{'draft_model'"),
    ("magicdec-streaming", {"controller": "oracle"}, r"method 'magicdec-streaming': controller must be one of"),
    ("medusa", {}, r"unknown method 'medusa'"),
])
def test_unknown_or_invalid_options_name_the_method_and_the_option(method, options, match):
    with pytest.raises(ValueError, match=match):
        resolve_method_options(method, options)


def test_a_spec_reports_a_bad_option_of_one_method(tmp_path):
    from cluster.sweep.schema import SpecError

    spec = _spec({"sparsespec-l": {}, "ngram": {"ngram_mx": 4}}, tmp_path)
    with pytest.raises(SpecError, match=r"unknown method_options \['ngram_mx'\] for method 'ngram' "
                                        r"\(did you mean 'ngram_max'\?\)"):
        check_methods(spec)


# ------------------------------------------------------------------ run ids
def _with_option(monkeypatch, method, **field_kwargs):
    """``method``'s drafter with one more option (``extra``), as a new drafter version would add."""
    drafter = DRAFTERS.get(method)
    base = drafter.options
    extra = dataclasses.make_dataclass(f"{base.__name__}Plus", [("extra", int, dataclasses.field(**field_kwargs))],
                                       bases=(base,), frozen=True)
    monkeypatch.setattr(drafter, "options", extra)
    return extra


def test_adding_an_option_to_one_method_leaves_the_other_methods_run_ids(monkeypatch, tmp_path):
    without_ngram = {"sparsespec-l": {"k": 4}, "magicdec-snapkv": {}, "eagle3": {"k": 2}}
    with_ngram = {"sparsespec-l": {"k": 4}, "ngram": {"k": 3}}
    before = {name: _ids(m, tmp_path) for name, m in (("without", without_ngram), ("with", with_ngram))}
    before_opts = {m: resolve_method_options(m, {}) for m in ("sparsespec-l", "magicdec-snapkv", "eagle3")}
    _with_option(monkeypatch, "ngram", default=0)
    assert "extra" in resolve_method_options("ngram", {})
    assert {m: resolve_method_options(m, {}) for m in before_opts} == before_opts
    assert _ids(without_ngram, tmp_path) == before["without"], "another method's option moved these run ids"
    assert _ids(with_ngram, tmp_path) != before["with"]  # a run of ngram hashes ngram's options


def test_a_later_option_keeps_its_own_methods_run_ids_at_its_default(monkeypatch, tmp_path):
    methods = {"sparsespec-l": {"k": 4}, "ngram": {"k": 3}}
    before = _ids(methods, tmp_path)
    extra = _with_option(monkeypatch, "ngram", default=0, metadata=later_option(0).metadata)
    assert "extra" not in resolve_method_options("ngram", {}) and extra(extra=0).resolved() == extra().resolved()
    assert _ids(methods, tmp_path) == before
    assert _ids({**methods, "ngram": {"k": 3, "extra": 2}}, tmp_path) != before
    assert resolve_method_options("ngram", {"extra": 2})["extra"] == 2


# ------------------------------------------------------------------ the migration
@pytest.mark.parametrize("method, options", CASES)
def test_the_migration_maps_the_old_form_to_the_new_resolution(method, options):
    """Revision 0003's frozen rewrite of a stored (old) option dict gives exactly what
    ``resolve_method_options`` gives now: the migrated ids are the ones a sweep plans. (A method
    that gains an option not declared ``later_option`` breaks this: its stored runs need a new
    revision.)"""
    assert MIGRATION.own_options(method, old_resolve(method, options)) == resolve_method_options(method, options)


def _old_store(url, tmp_path):
    """A store at revision 0002 (before per-method options) holding a sweep of ``_spec`` as the
    previous code wrote it: ids hashed from the old option form, shards done, their results, an
    event and a bench run that lists the sweep's runs; plus a run not made by the planner."""
    from alembic import command

    spec = _spec({**METHODS, "magicdec-streaming": {"budget_frac": 0.2}}, tmp_path)
    old_opts = {m: old_resolve(m, o) for m, o in spec.methods.items()}
    cells = plan_cells(spec, old_opts, _info)
    eng = _engine(url)
    with eng.begin() as conn:
        command.upgrade(alembic_config(conn), "0002")
    st = Store(eng)
    keys = {}
    for c in cells:
        st.start_run(c.run_id, benchmark=c.benchmark, model=c.model, methods=c.config["methods"], config=c.config)
        for sh in plan_shards(c):
            st.start_shard(c.run_id, sh.key, task=sh.task, sample_ids=[s.sample_id for s in sh.samples])
            rows = [dict(run_id=c.run_id, benchmark=c.benchmark, task=sh.task, model=c.model, method=m,
                         sample_id=s.sample_id, prediction="", token_ids=[1, 2], score=None,
                         stats={"batch_key": sh.key, "num_output_tokens": 2, "step_trace": [[2, 1]]},
                         lossless=None, first_divergence=None, num_input_tokens_raw=5, num_input_tokens=5,
                         references=[]) for s in sh.samples for m in sh.methods]
            st.complete_shard(c.run_id, sh.key, rows)
            keys.setdefault(c.run_id, set()).add(sh.key)
        st.record_event(c.run_id, "worker died", shard=f"{c.run_id}/fixed/0")
    ids = [c.run_id for c in cells]
    st.start_run("bench-0123", benchmark="bench", model="m", methods=["ar"], config={"e2e_run_ids": ids})
    st.add_bench_rows("bench-0123", "m", "cpu", [{"kind": "e2e", "context_len": 200, "batch_size": 2,
                                                  "method": "ar", "run_ids": ids}])
    st.start_run("hand-made", benchmark="speed", model="m", methods=["ar"], config={"method_options": {}})
    st.close()
    return spec, cells, keys


def test_a_store_written_before_resumes_under_the_new_ids(tmp_path, db_url):  # noqa: F811
    url = db_url
    spec, old_cells, old_keys = _old_store(url, tmp_path)
    with open_store(url) as st:  # a writer upgrades it: 0002 -> 0003
        assert st.revision() == head_revision() == "0004"
        new_cells = plan_cells(spec, check_methods(spec), _info)
        assert len(new_cells) == len(old_cells) == 1
        (old,), (new,) = old_cells, new_cells
        assert new.run_id != old.run_id and st.run_id_map() == {old.run_id: new.run_id}
        assert st.get_run(old.run_id) is None
        run = st.get_run(new.run_id)
        assert run["config"] == new.config and compute_run_id(new.benchmark, run["config"]) == new.run_id
        assert run["config"]["method_options"]["ngram"] == {"k": 3, "max_k": 16, "ngram_min": 1, "ngram_max": 3}
        assert run["events"][0]["shard"] == f"{new.run_id}/fixed/0"
        # what cluster.sweep.run checks to resume: every planned shard is done, nothing left to run
        planned = {sh.key for sh in plan_shards(new)}
        assert planned == st.done_shards(new.run_id) and len(planned) == len(old_keys[old.run_id]) == 2
        results = st.results(run_ids=[new.run_id])
        assert len(results) == 3 * len(spec.methods) and st.results(run_ids=[old.run_id]) == []
        assert {r["stats"]["batch_key"] for r in results} == planned
        assert len(st.acceptance_steps(new.run_id)) == 3 * (len(spec.methods) - 1) + 3  # traces kept
        # the bench run keeps its own id and lists the sweep's new one
        assert st.get_run("bench-0123")["config"]["e2e_run_ids"] == [new.run_id]
        assert st.bench_rows("bench-0123")[0]["run_ids"] == [new.run_id]
        assert st.get_run("hand-made") is not None  # not a planner's id: left alone
        with st.engine.connect() as c:
            (m,) = c.execute(select(RunIdMap.__table__)).mappings().all()
        assert m["old_config"] == old.config and m["revision"] == "0003" and m["note"] is None
    # down again: the old ids, configs and keys come back
    from alembic import command

    eng = _engine(url)
    with eng.begin() as conn:
        command.downgrade(alembic_config(conn), "0002")
    st = Store(eng)
    try:
        assert "run_id_map" not in inspect(eng).get_table_names()
        assert current_revision(eng) == "0002"
        assert st.get_run(old.run_id)["config"] == old.config and st.get_run(new.run_id) is None
        assert st.done_shards(old.run_id) == old_keys[old.run_id]
        assert {r["stats"]["batch_key"] for r in st.results(run_ids=[old.run_id])} == old_keys[old.run_id]
        assert st.get_run("bench-0123")["config"]["e2e_run_ids"] == [old.run_id]
    finally:
        st.close()


def test_two_old_runs_that_differ_only_in_foreign_options_keep_one_new_id(tmp_path, db_url):  # noqa: F811
    """ngram with two budget_frac values (an option ngram never read) were two runs; only one can
    take the new id, the other keeps its own, with the reason recorded."""
    from alembic import command

    url = db_url
    spec = _spec({"ngram": {"k": 2}}, tmp_path)
    ids = []
    eng = _engine(url)
    with eng.begin() as conn:
        command.upgrade(alembic_config(conn), "0002")
    st = Store(eng)
    for frac in (0.1, 0.3):
        (c,) = plan_cells(spec, {"ar": {}, "ngram": old_resolve("ngram", {"k": 2, "budget_frac": frac})}, _info)
        st.start_run(c.run_id, benchmark=c.benchmark, model=c.model, methods=c.config["methods"], config=c.config)
        ids.append(c.run_id)
    st.close()
    with open_store(url) as st:
        (new,) = plan_cells(spec, check_methods(spec), _info)
        moved = st.run_id_map()
        assert list(moved.values()) == [new.run_id] and set(moved) < set(ids)
        kept = (set(ids) - set(moved)).pop()
        assert {r["run_id"] for r in st.runs()} == {new.run_id, kept}
        with st.engine.connect() as c:
            notes = {r.old_run_id: r.note for r in c.execute(select(RunIdMap.__table__))}
        assert notes[kept].startswith(f"kept: {new.run_id} is already taken")


def test_the_frozen_hash_is_the_planners():
    config = json.loads(json.dumps({"benchmark": "speed", "method_options": {"ngram": {"k": 2}}, "x": [1, 0.5]}))
    assert MIGRATION.run_id_of("speed", config) == compute_run_id("speed", config)
