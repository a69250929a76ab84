"""Coordinator + worker with the fake engine through local Ray: pairing, resume, retries."""
import functools

import pytest

from cluster.coordinator import (
    ShardFailedError,
    WorkerStartError,
    compute_run_id,
    first_divergence,
    lossless_check,
    normalize_methods,
    plan_shards,
    resolve_config,
    run_benchmark,
)
from cluster.fake import FakeEngine, fake_engine_factory
from cluster.report import report_rows
from cluster.store import open_store
from cluster.worker import EngineWorker, Shard, method_order
from evals.base import Sample

POISON = 999  # a prompt holding this token kills a FakeEngine built with die_on_token=POISON


def make_samples(tasks=("t1", "t2"), n=3, max_new_tokens=6, poison=None):
    out = []
    for t in tasks:
        for i in range(n):
            ids = (1, 2, 3, 10 + i, 20 + len(t))
            if poison == (t, f"s{i}"):
                ids = ids + (POISON,)
            out.append(Sample(benchmark="bench", task=t, sample_id=f"s{i}", prompt_ids=ids, references=("t1",),
                              max_new_tokens=max_new_tokens, num_input_tokens_raw=len(ids) + 5,
                              num_input_tokens=len(ids)))
    return out


def scorer(sample, prediction):
    return 1.0 if sample.references[0] in prediction.split() else 0.0


def _run(db, samples, **kw):
    kw.setdefault("methods", ["sparsespec-l"])
    kw.setdefault("method_options", {"sparsespec-l": {"k": 4}})
    kw.setdefault("engine_factory", fake_engine_factory)
    return run_benchmark(benchmark="bench", samples=samples, scorer=scorer, model="fake", db_url=db,
                         config={"purpose": "test"}, progress=False, **kw)


# ----------------------------------------------------------------------------- pure parts
def test_methods_normalised_ar_first():
    assert normalize_methods(["sparsespec-l"]) == ["ar", "sparsespec-l"]
    assert normalize_methods(["x", "ar", "x", " y "]) == ["ar", "x", "y"]
    assert normalize_methods("a,b") == ["ar", "a", "b"]


def test_run_id_is_deterministic_and_config_sensitive():
    s = make_samples()
    base = dict(benchmark="bench", model="m", methods=["ar", "x"], dtype="float32",
                method_options={"x": {"k": 4}}, temperature=0.0, config={"a": 1}, samples=s)
    rid = compute_run_id(resolve_config(**base))
    assert rid == compute_run_id(resolve_config(**base))
    assert rid.startswith("bench-")
    for change in ({"dtype": "bfloat16"}, {"method_options": {"x": {"k": 8}}}, {"config": {"a": 2}},
                   {"samples": s[:-1]}, {"temperature": 0.5}):
        assert compute_run_id(resolve_config(**{**base, **change})) != rid, change


def test_plan_shards_keeps_methods_of_a_sample_together():
    samples = make_samples(n=5)
    shards = plan_shards(samples, ["ar", "m"], set(), method_options={"m": {"k": 2}}, temperature=0.0,
                         shard_size=2)
    assert [(sh.task, [s.sample_id for s in sh.samples]) for sh in shards] == [
        ("t1", ["s0", "s1"]), ("t1", ["s2", "s3"]), ("t1", ["s4"]),
        ("t2", ["s0", "s1"]), ("t2", ["s2", "s3"]), ("t2", ["s4"])]
    assert all(sh.methods == ("ar", "m") for sh in shards)
    assert [sh.sample_offset for sh in shards[:3]] == [0, 2, 4]
    assert shards[0].method_options == {"ar": {}, "m": {"k": 2}}
    # resume: skip what is done; a partly done sample only reruns its missing methods
    done = {("t1", "s0", "ar"), ("t1", "s0", "m"), ("t1", "s1", "m")}
    shards = plan_shards(samples[:3], ["ar", "m"], done, method_options={}, temperature=0.0, shard_size=8)
    assert [([s.sample_id for s in sh.samples], sh.methods, sh.sample_offset) for sh in shards] == [
        (["s1"], ("ar",), 1), (["s2"], ("ar", "m"), 2)]


def test_method_order_alternates():
    assert [method_order(["ar", "m"], j) for j in range(3)] == [["ar", "m"], ["m", "ar"], ["ar", "m"]]
    assert method_order(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_lossless_check():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    drafted = {"num_drafted": 4}
    assert lossless_check([1, 2], [1, 2], drafted, 0.0) == (True, None)
    assert lossless_check([1, 2], [1, 3], drafted, 0.0) == (False, 1)
    assert lossless_check([1, 2], [1, 2], {"num_drafted": 0}, 0.0) == (None, None)  # inconclusive
    assert lossless_check([1, 2], [1, 3], drafted, 0.7) == (None, None)  # sampling: not per-token
    assert lossless_check(None, [1], drafted, 0.0) == (None, None)


def test_worker_without_ray_warms_up_once_and_interleaves():
    w = EngineWorker("fake", "float32", None, fake_engine_factory)
    samples = tuple(make_samples(tasks=("t1",), n=2))
    shard = Shard(task="t1", samples=samples, methods=("ar", "m"), method_options={"m": {"k": 2}},
                  sample_offset=0)
    out = w.run_shard(shard)
    assert [(o["sample_id"], o["method"]) for o in out] == [("s0", "ar"), ("s0", "m"), ("s1", "m"), ("s1", "ar")]
    calls = w.engine.calls
    assert len(calls) == 2 + 4  # one warm-up per method, then the four recorded generations
    assert [(c["method"], c["max_new_tokens"]) for c in calls[:2]] == [("ar", 6), ("m", 6)]
    assert calls[1]["method_options"] == {"k": 2}
    assert set(out[0]) == {"task", "sample_id", "method", "token_ids", "text", "stats"}
    w.run_shard(shard)
    assert len(w.engine.calls) == 6 + 4  # no second warm-up



def test_worker_passes_the_samples_stopping_rule_to_the_engine():
    """A task's official stopping rule (LongBench samsum: the newline id as an extra EOS, at least
    one token) reaches ``generate``; samples without one pass nothing."""
    import dataclasses

    w = EngineWorker("fake", "float32", None, fake_engine_factory)
    plain, stopped, strings = make_samples(tasks=("t1",), n=3)
    stopped = dataclasses.replace(stopped, meta={**stopped.meta, "stop_token_ids": [198], "min_new_tokens": 1})
    strings = dataclasses.replace(strings, meta={**strings.meta, "stop": ["\n"]})
    w.run_shard(Shard(task="t1", samples=(plain, stopped, strings), methods=("ar",), method_options={},
                      sample_offset=0))
    recorded = [(c["stop"], c["stop_token_ids"], c["min_new_tokens"]) for c in w.engine.calls[1:]]  # after warm-up
    assert recorded == [(None, None, 0), (None, [198], 1), (["\n"], None, 0)]

# ----------------------------------------------------------------------------- through Ray
def test_run_pairs_resumes_and_adds_ar(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    samples = make_samples()
    rid = _run(db, samples, shard_size=2)
    with open_store(db) as st:
        rows = st.results(rid)
        run = st.get_run(rid)
    assert run["methods"] == ["ar", "sparsespec-l"] and run["status"] == "finished"
    assert run["host"]["workers"][0]["engine"] == "FakeEngine"
    assert len(rows) == 12
    assert {r["method"] for r in rows} == {"ar", "sparsespec-l"}
    by = {(r["task"], r["sample_id"], r["method"]): r for r in rows}
    for s in samples:
        ar, sp = by[(s.task, s.sample_id, "ar")], by[(s.task, s.sample_id, "sparsespec-l")]
        assert ar["stats"]["worker_pid"] == sp["stats"]["worker_pid"]  # same actor
        j = int(s.sample_id[1:])
        assert ar["stats"]["order_in_sample"] == j % 2  # interleaved, alternating
        assert sp["lossless"] is True and ar["lossless"] is None
        assert sp["token_ids"] == ar["token_ids"] and sp["stats"]["num_drafted"] > 0
        assert ar["score"] == scorer(s, ar["prediction"])
        assert ar["references"] == ["t1"] and ar["num_input_tokens_raw"] == s.num_input_tokens_raw
    ids_before = sorted(r["id"] for r in rows)

    # same config again: same run id, nothing runs (a factory that cannot build would fail otherwise)
    def no_engine(model, dtype):
        raise AssertionError("no worker should start on a finished run")

    assert _run(db, samples, shard_size=2, engine_factory=no_engine) == rid
    with open_store(db) as st:
        assert sorted(r["id"] for r in st.results(rid)) == ids_before

    rep = {r["method"]: r for r in report_rows(db, [rid]) if r["task"] == "t1"}
    assert rep["sparsespec-l"]["lossless_rate"] == 1.0 and rep["sparsespec-l"]["n"] == 3
    assert rep["sparsespec-l"]["speedup"] > 1.0 and rep["ar"]["speedup"] == 1.0


def test_lossy_method_and_sampling(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    samples = make_samples(tasks=("t1",), n=2)
    rid = _run(db, samples, method_options={"sparsespec-l": {"k": 4, "diverge_at": 3}})
    with open_store(db) as st:
        sp = st.results(rid, method="sparsespec-l")
    assert [(r["lossless"], r["first_divergence"]) for r in sp] == [(False, 3), (False, 3)]
    assert report_rows(db, [rid])[1]["lossless_rate"] == 0.0
    rid2 = _run(db, samples, temperature=0.8)
    assert rid2 != rid
    with open_store(db) as st:
        assert {r["lossless"] for r in st.results(rid2)} == {None}


def test_worker_death_is_retried_once(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    samples = make_samples(tasks=("t1",), n=4, poison=("t1", "s2"))
    factory = functools.partial(FakeEngine, die_on_token=POISON, die_marker=str(tmp_path / "died-once"))
    rid = _run(db, samples, engine_factory=factory, shard_size=2)
    assert (tmp_path / "died-once").exists()
    with open_store(db) as st:
        rows = st.results(rid)
        run = st.get_run(rid)
    assert len(rows) == 8 and run["status"] == "finished"
    (event,) = run["events"]
    assert "worker died" in event["message"] and event["samples"] == ["s2", "s3"]
    pids = {r["sample_id"]: r["stats"]["worker_pid"] for r in rows}
    assert pids["s0"] == pids["s1"] != pids["s2"] == pids["s3"]  # retried shard ran on a new actor


def test_worker_dying_twice_fails_clearly_then_resumes(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    samples = make_samples(tasks=("t1",), n=4, poison=("t1", "s2"))
    factory = functools.partial(FakeEngine, die_on_token=POISON)
    with pytest.raises(ShardFailedError) as e:
        _run(db, samples, engine_factory=factory, shard_size=2)
    assert "failed twice" in str(e.value) and "s2" in str(e.value) and "task='t1'" in str(e.value)
    with open_store(db) as st:
        (run,) = st.runs()
        assert run["status"] == "failed"
        assert sum(ev["message"].startswith("worker died") for ev in run["events"]) == 2
        assert run["events"][-1]["message"].startswith("run failed: ShardFailedError")
        assert st.done_keys(run["run_id"]) == {("t1", s, m) for s in ("s0", "s1") for m in ("ar", "sparsespec-l")}
    # the same config with a healthy engine resumes the same run and only runs what is missing
    rid = _run(db, samples, shard_size=2)
    assert rid == run["run_id"]
    with open_store(db) as st:
        rows = st.results(rid)
        assert len(rows) == 8 and st.get_run(rid)["status"] == "finished"
    pids = {r["sample_id"]: r["stats"]["worker_pid"] for r in rows}
    assert pids["s0"] != pids["s2"]


def test_engine_error_is_not_retried(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    with pytest.raises(ShardFailedError, match="raised in the worker") as e:
        _run(db, make_samples(tasks=("t1",), n=1), method_options={"sparsespec-l": {"raise": "kaboom"}})
    assert "kaboom" in str(e.value) and "shard #0" in str(e.value)
    with open_store(db) as st:
        (run,) = st.runs()
    assert run["status"] == "failed" and not any("worker died" in ev["message"] for ev in run["events"])


def test_bad_inputs_are_rejected(tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"
    s = make_samples(tasks=("t1",), n=1)
    with pytest.raises(ValueError, match="no samples"):
        _run(db, [])
    with pytest.raises(ValueError, match="duplicate"):
        _run(db, s + s)
    with pytest.raises(ValueError, match="method_options"):
        _run(db, s, method_options={"other": {"k": 1}})


def test_engine_load_failure_is_a_clear_error(ray_session, tmp_path):
    db = f"sqlite:///{tmp_path}/res.db"

    def _broken_factory(model, dtype):  # local: pickled by value (workers cannot import tests/)
        raise OSError(f"no weights for {model}")

    with pytest.raises(WorkerStartError, match="failed to start") as e:
        _run(db, make_samples(tasks=("t1",), n=1), engine_factory=_broken_factory)
    assert "no weights for fake" in str(e.value)
    with pytest.raises(ValueError, match="only 2 CPU"):
        _run(db, make_samples(tasks=("t1",), n=1), num_workers=3)
