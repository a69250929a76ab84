"""Result store round trip on SQLite (and PostgreSQL when SPARSESPEC_TEST_PG_URL is set)."""
import os

import pytest
from sqlalchemy.exc import IntegrityError

from cluster.results.store import (
    RESULT_FIELDS,
    StoreNotFoundError,
    StoreURLError,
    open_store,
)
from tests.helpers import fresh_pg_database


def _row(run_id="r1", task="t", sample_id="s1", method="ar", **kw):
    row = dict(
        run_id=run_id, benchmark="ruler", task=task, model="m", method=method, sample_id=sample_id,
        prediction="the answer", token_ids=[5, 6, 7], score=0.5,
        stats={"num_output_tokens": 3, "decode_s": 0.25, "accept_hist": {"4:2": 3}},
        lossless=None, first_divergence=None, num_input_tokens_raw=120, num_input_tokens=100,
        references=["answer", "other"],
    )
    row.update(kw)
    return row


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = open_store(f"sqlite:///{tmp_path}/nested/dir/results.db")
        yield s
        s.close()
        return
    url = os.environ.get("SPARSESPEC_TEST_PG_URL")
    if not url:
        pytest.skip("set SPARSESPEC_TEST_PG_URL=postgresql+psycopg://... to test PostgreSQL")
    with fresh_pg_database(url) as own:  # start clean: a new database, migrated from nothing
        s = open_store(own)
        yield s
        s.close()


def test_open_creates_parent_dirs_and_tables(tmp_path):
    db = tmp_path / "a" / "b" / "x.db"
    with open_store(f"sqlite:///{db}") as s:
        assert db.exists()
        assert s.has_tables
        assert s.runs() == [] and s.acceptance_steps() == []
        from cluster.results.store import head_revision

        assert s.revision() == head_revision()


def test_round_trip_idempotent_and_done_keys(store):
    assert store.start_run("r1", benchmark="ruler", model="m", methods=["ar", "sparsespec-l"],
                           config={"k": 4, "nested": {"a": [1, 2]}}, host={"hostname": "h"})
    rows = [
        _row(),
        _row(method="sparsespec-l", lossless=False, first_divergence=2, token_ids=[5, 6, 9], score=1.0),
        _row(task="t2", sample_id="s9", score=None),
    ]
    assert store.add_results(rows) == 3
    # re-insert: nothing new, even if the payload differs (first write wins)
    assert store.add_results([_row(prediction="changed")] + rows) == 0
    got = store.results("r1")
    assert len(got) == 3
    first = got[0]
    for k in RESULT_FIELDS:
        assert first[k] == rows[0][k], k
    assert got[1]["lossless"] is False and got[1]["first_divergence"] == 2
    assert got[2]["score"] is None and got[2]["lossless"] is None
    assert store.done_keys("r1") == {("t", "s1", "ar"), ("t", "s1", "sparsespec-l"), ("t2", "s9", "ar")}
    assert store.done_keys("other") == set()
    assert [r["method"] for r in store.results("r1", method="sparsespec-l")] == ["sparsespec-l"]
    assert store.token_ids("r1", "ar") == {("t", "s1"): [5, 6, 7], ("t2", "s9"): [5, 6, 7]}

    run = store.get_run("r1")
    assert run["methods"] == ["ar", "sparsespec-l"]
    assert run["config"] == {"k": 4, "nested": {"a": [1, 2]}}
    assert run["status"] == "running" and run["finished_at"] is None
    store.record_event("r1", "worker died", shard=3)
    store.finish_run("r1")
    run = store.get_run("r1")
    assert run["status"] == "finished" and run["finished_at"] is not None
    assert run["events"][0]["message"] == "worker died" and run["events"][0]["shard"] == 3
    # resuming keeps created_at and flips the status back
    assert store.start_run("r1", benchmark="ruler", model="m", methods=["ar"], config={}) is False
    again = store.get_run("r1")
    assert again["created_at"] == run["created_at"] and again["status"] == "running"
    (listed,) = store.runs()
    assert listed["run_id"] == "r1" and listed["num_results"] == 3


def test_result_needs_its_run(store):
    with pytest.raises(IntegrityError):
        store.add_results([_row(run_id="missing-run")])


def test_rows_of_two_runs_do_not_collide(store):
    for rid in ("a", "b"):
        store.start_run(rid, benchmark="ruler", model="m", methods=["ar"], config={})
        assert store.add_results([_row(run_id=rid)]) == 1
    assert len(store.results()) == 2
    assert len(store.results(["a"])) == 1


@pytest.mark.parametrize("url", ["results.db", "", "nosuchdialect://x/y", "postgresql+asyncpg://u@h/db"])
def test_bad_url_is_a_clear_error(url):
    with pytest.raises(StoreURLError) as e:
        open_store(url)
    assert "sqlite:///" in str(e.value)


def test_readers_do_not_create(tmp_path):
    db = tmp_path / "none" / "x.db"
    with pytest.raises(StoreNotFoundError, match="no database"):
        open_store(f"sqlite:///{db}", create=False)
    assert not db.parent.exists()
    # an existing file without tables reads as empty
    db.parent.mkdir()
    db.touch()
    with open_store(f"sqlite:///{db}", create=False) as s:
        assert not s.has_tables
        assert s.results() == [] and s.runs() == [] and s.done_keys("r") == set()
        assert s.acceptance_steps() == [] and s.revision() is None
    assert db.stat().st_size == 0, "a reader writes nothing"


def test_password_is_masked_in_errors():
    from cluster.results.store import StoreError

    with pytest.raises(StoreError) as e:
        open_store("postgresql+psycopg://user:hunter2@127.0.0.1:1/db")
    assert "hunter2" not in str(e.value)


def test_shard_lifecycle_and_atomic_completion(store):
    from cluster.results.store import StoreError

    store.start_run("r1", benchmark="ruler", model="m", methods=["ar"], config={"context_length": 512,
                                                                              "batch_size": 2})
    with pytest.raises(StoreError, match="never started"):
        store.complete_shard("r1", "r1/t/0", [_row()])
    assert store.start_shard("r1", "r1/t/0", task="t", sample_ids=["s1"], worker={"pid": 1}) == 1
    store.fail_shard("r1", "r1/t/0", "worker died", final=False)
    assert store.start_shard("r1", "r1/t/0", task="t", sample_ids=["s1"], worker={"pid": 2}) == 2
    # a row that breaks the transaction (no such run) leaves neither results nor a done mark
    with pytest.raises(Exception):
        store.complete_shard("r1", "r1/t/0", [_row(), _row(run_id="nope", sample_id="s2")])
    assert store.results("r1") == [] and store.done_shards("r1") == set()
    assert store.complete_shard("r1", "r1/t/0", [_row(), _row(method="x")], wall_s=1.5) == 2
    assert store.done_shards("r1") == {"r1/t/0"}
    (sh,) = store.shards("r1")
    assert (sh["status"], sh["attempts"], sh["error"], sh["wall_s"]) == ("done", 2, None, 1.5)
    with pytest.raises(StoreError, match="already done"):
        store.start_shard("r1", "r1/t/0", task="t", sample_ids=["s1"])
    # results carry the run's cell
    assert {(r["context_length"], r["batch_size"]) for r in store.results("r1")} == {(512, 2)}
    # failed for good, then released/resumable; running shards of a dead driver go back to pending
    store.start_shard("r1", "r1/t/1", task="t", sample_ids=["s3"])
    store.fail_shard("r1", "r1/t/1", "boom", final=True)
    store.start_shard("r1", "r1/t/2", task="t", sample_ids=["s4"])
    assert store.release_running("r1") == 1
    assert {s["key"]: s["status"] for s in store.shards("r1")} == {
        "r1/t/0": "done", "r1/t/1": "failed", "r1/t/2": "pending"}


def test_serve_requests_round_trip_and_idempotent(store):
    rows = [
        dict(request_id="cmpl-1", experiment="e", model="m", arm="ar", method="ar", session="s1",
             endpoint="completions", stream=True, status=200, finish_reason="length", prompt_tokens=10,
             output_tokens=4, max_tokens=4, temperature=0.0, queue_s=0.001, ttft_s=0.05, e2el_s=0.2,
             stats={"num_drafted": 0, "chunk_gaps_s": [0.05, 0.05, float("nan")]}),
        dict(request_id="rej-1", experiment="e", model="m", endpoint="chat.completions", status=400,
             error="temperature: bad"),
    ]
    assert store.add_serve_requests(rows) == 2
    assert store.add_serve_requests(rows[:1]) == 0  # a re-sent batch is not stored twice
    got = store.serve_requests("e")
    assert [r["request_id"] for r in got] == ["cmpl-1", "rej-1"]
    assert got[0]["arm"] == "ar" and got[0]["output_tokens"] == 4 and got[0]["stream"] is True
    assert got[0]["stats"]["chunk_gaps_s"] == [0.05, 0.05, None]  # non-finite floats stored as null
    assert got[1]["arm"] is None and got[1]["status"] == 400
    assert store.serve_requests("other") == []
    with pytest.raises(ValueError, match="unknown fields"):
        store.add_serve_requests([dict(request_id="x", experiment="e", model="m", endpoint="c", status=200,
                                       bogus=1)])


def test_each_postgresql_test_gets_a_database_of_its_own():
    """The PostgreSQL fixtures' helper: a new empty database per use, never the server's shared one
    (tests on two xdist workers creating one table name in one database raced), dropped after."""
    url = os.environ.get("SPARSESPEC_TEST_PG_URL")
    if not url:
        pytest.skip("set SPARSESPEC_TEST_PG_URL=postgresql+psycopg://... to test PostgreSQL")
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.engine import make_url

    def databases() -> set[str]:
        eng = create_engine(url)
        try:
            with eng.connect() as c:
                return {r[0] for r in c.execute(text("SELECT datname FROM pg_database"))}
        finally:
            eng.dispose()

    with fresh_pg_database(url) as a, fresh_pg_database(url) as b:
        names = {make_url(a).database, make_url(b).database}
        assert len(names) == 2 and make_url(url).database not in names
        assert names <= databases()
        eng = create_engine(a)
        try:
            assert inspect(eng).get_table_names() == []
        finally:
            eng.dispose()
    assert not names & databases()
