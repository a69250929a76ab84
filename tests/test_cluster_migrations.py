"""Schema migrations of the result store (Alembic, ``cluster/results/migrations``) and the per-step
acceptance trace, on SQLite and (when SPARSESPEC_TEST_PG_URL is set) PostgreSQL."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, create_engine, delete, inspect, text

from cluster.results.store import (
    ACCEPTANCE_STEP_FIELDS,
    BASE_REVISION,
    Base,
    Result,
    Store,
    StoreError,
    alembic_config,
    current_revision,
    head_revision,
    main,
    open_store,
)
from tests.helpers import fresh_pg_database

ROOT = Path(__file__).resolve().parents[1]
STORE_TABLES = {"runs", "results", "shards", "bench", "serve_requests", "acceptance_steps", "run_id_map"}
LEGACY_TABLES = ("runs", "results", "shards", "bench", "serve_requests")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/db/m.db"
        return
    url = os.environ.get("SPARSESPEC_TEST_PG_URL")
    if not url:
        pytest.skip("set SPARSESPEC_TEST_PG_URL=postgresql+psycopg://... to test PostgreSQL")
    with fresh_pg_database(url) as own:  # a database of its own: xdist workers never share one
        yield own


def _engine(url):
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return create_engine(url)


def _alembic(url_or_engine, fn, *args):
    """Run an alembic command (``command.upgrade`` ...) on the database, in one transaction."""
    eng = _engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        with eng.begin() as conn:
            fn(alembic_config(conn), *args)
    finally:
        if eng is not url_or_engine:
            eng.dispose()


def _tables(url):
    eng = _engine(url)
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def _diffs(engine, metadata=Base.metadata):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)


def _row(run_id="r1", task="t", sample_id="s1", method="sparsespec-l", trace=None, **kw):
    stats = {"num_output_tokens": 3, "num_steps": len(trace or []), "decode_s": 0.25}
    if trace is not None:
        stats["step_trace"] = trace
    row = dict(run_id=run_id, benchmark="ruler", task=task, model="m", method=method, sample_id=sample_id,
               prediction="p", token_ids=[5, 6, 7], score=0.5, stats=stats, lossless=True, first_divergence=None,
               num_input_tokens_raw=120, num_input_tokens=100, references=["p"])
    row.update(kw)
    return row


# ------------------------------------------------------------------ schema
def test_upgrade_from_empty_matches_the_models(db_url):
    with open_store(db_url) as st:
        assert st.revision() == head_revision() == "0004"
        assert STORE_TABLES <= set(inspect(st.engine).get_table_names())
        assert _diffs(st.engine) == [], "the models changed without a migration (cluster/results/migrations/versions)"
        # the check bites: a model column the migrations do not create is a difference
        changed = MetaData()
        for t in Base.metadata.tables.values():
            t.to_metadata(changed)
        changed.tables["acceptance_steps"].append_column(Column("extra", Integer, nullable=True))
        assert [d[0] for d in _diffs(st.engine, changed)] == ["add_column"]
        # down to nothing and up again
        from alembic import command

        _alembic(st.engine, command.downgrade, "base")
        assert not STORE_TABLES & set(inspect(st.engine).get_table_names())
        assert current_revision(st.engine) is None
        _alembic(st.engine, command.upgrade, "head")
        assert current_revision(st.engine) == "0004" and _diffs(st.engine) == []


@pytest.mark.parametrize("missing", [(), ("shards", "bench", "serve_requests")])
def test_a_database_from_before_migrations_is_adopted_and_keeps_its_rows(db_url, missing):
    """Made by the old ``create_all`` code: the 0001 tables (or an older subset), no
    ``alembic_version``. Readers see it as it is; a writer stamps it 0001 and upgrades it."""
    from alembic import command

    eng = _engine(db_url)
    _alembic(eng, command.upgrade, BASE_REVISION)
    with eng.begin() as c:
        c.execute(text("DROP TABLE alembic_version"))
        for t in reversed(missing):
            c.execute(text(f"DROP TABLE {t}"))
    old = Store(eng)  # the store's writes work on the old schema (no trace table: traces are skipped)
    old.start_run("r1", benchmark="ruler", model="m", methods=["ar", "sparsespec-l"],
                  config={"context_length": 512, "batch_size": 2})
    assert old.add_results([_row(method="ar"), _row(trace=[[3, 2], [3, 3]])]) == 2
    if not missing:
        old.start_shard("r1", "r1/t/0", task="t", sample_ids=["s1"])
        old.add_serve_requests([dict(request_id="q1", experiment="e", model="m", endpoint="completions",
                                     status=200)])
        old.add_bench_rows("r1", "m", "cpu", [dict(kind="steps", context_len=512, batch_size=1, x=1.0)])
    eng.dispose()

    assert main(["current", "--db", db_url]) == 0
    with open_store(db_url, create=False) as reader:  # readers never migrate; missing tables read empty
        assert reader.revision() is None
        assert len(reader.results()) == 2 and reader.acceptance_steps() == []
        if missing:
            assert reader.shards() == [] and reader.serve_requests() == [] and reader.bench_rows() == []
    assert "acceptance_steps" not in _tables(db_url)

    with open_store(db_url) as st:
        assert st.revision() == head_revision()
        assert STORE_TABLES <= set(inspect(st.engine).get_table_names())
        assert _diffs(st.engine) == []
        got = st.results("r1")
        assert [(r["method"], r["stats"].get("step_trace")) for r in got] == [("ar", None), ("sparsespec-l", None)]
        assert st.get_run("r1")["config"] == {"context_length": 512, "batch_size": 2}
        if not missing:
            assert [s["key"] for s in st.shards("r1")] == ["r1/t/0"]
            assert [r["request_id"] for r in st.serve_requests()] == ["q1"]
            assert [r["x"] for r in st.bench_rows("r1")] == [1.0]
        # it works as a head database: new rows get their trace
        assert st.add_results([_row(sample_id="s2", trace=[[2, 1]])]) == 1
        assert [(r["sample_id"], r["k"], r["accepted"]) for r in st.acceptance_steps()] == [("s2", 2, 1)]


def test_a_database_from_a_newer_version_is_readable_but_not_migrated(db_url, capsys):
    open_store(db_url).close()
    eng = _engine(db_url)
    with eng.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    eng.dispose()
    with pytest.raises(StoreError, match="newer version"):
        open_store(db_url)
    with open_store(db_url, create=False) as reader:
        assert reader.revision() == "0099" and reader.results() == [] and reader.acceptance_steps() == []
    assert main(["upgrade", "--db", db_url]) == 1 and "0099" in capsys.readouterr().err
    assert main(["current", "--db", db_url]) == 0
    assert capsys.readouterr().out.startswith("0099 (unknown to this code")


def test_in_memory_database():
    with open_store("sqlite://") as st:
        assert st.revision() == head_revision()
        st.start_run("r", benchmark="b", model="m", methods=["ngram"], config={})
        assert st.add_results([_row(run_id="r", trace=[[1, 1]])]) == 1
        assert [(r["k"], r["accepted"]) for r in st.acceptance_steps()] == [(1, 1)]


# ------------------------------------------------------------------ command line
def test_cli_upgrade_and_current(db_url, capsys):
    assert main(["upgrade", "--db", db_url]) == 0
    assert capsys.readouterr().out.strip().endswith(": none -> 0004")
    assert main(["upgrade", "--db", db_url]) == 0
    assert capsys.readouterr().out.strip().endswith(": 0004 -> 0004 (already at head)")
    assert main(["current", "--db", db_url]) == 0
    assert capsys.readouterr().out.strip() == "0004 (head)"
    from alembic import command

    _alembic(db_url, command.downgrade, "0001")
    assert main(["current", "--db", db_url]) == 0
    assert capsys.readouterr().out.startswith("0001 (head is 0004")
    assert main(["upgrade", "--db", db_url]) == 0
    assert capsys.readouterr().out.strip().endswith(": 0001 -> 0004")


def test_0004_flags_warmups_keeps_older_rows_and_goes_back(db_url):
    """Rows stored before 0004 become measured requests (warmup false); after it, a warm-up row is
    left out of ``serve_requests()`` unless asked; downgrading drops the column, not the rows."""
    from alembic import command

    row = dict(experiment="e", model="m", arm="ar", method="ar", endpoint="completions", status=200,
               output_tokens=4)
    _alembic(db_url, command.upgrade, "0003")
    eng = _engine(db_url)
    try:
        with eng.begin() as c:
            c.execute(text("INSERT INTO serve_requests (request_id, experiment, model, arm, method, endpoint, "
                           "stream, status, output_tokens, created_at) VALUES ('old', 'e', 'm', 'ar', 'ar', "
                           "'completions', false, 200, 4, CURRENT_TIMESTAMP)"))
    finally:
        eng.dispose()
    with open_store(db_url, create=False) as reader:  # readers never migrate: no column, no warm-ups
        assert [(q["request_id"], q["warmup"]) for q in reader.serve_requests("e", warmups=True)] == [("old", False)]
    with open_store(db_url) as st:
        assert st.revision() == "0004"
        st.add_serve_requests([{**row, "request_id": "warm", "warmup": True}, {**row, "request_id": "new"}])
        assert [q["request_id"] for q in st.serve_requests("e")] == ["old", "new"]
        assert [q["warmup"] for q in st.serve_requests("e")] == [False, False]
        assert [q["request_id"] for q in st.serve_requests("e", warmups=True)] == ["old", "warm", "new"]
        _alembic(st.engine, command.downgrade, "0003")
        assert "warmup" not in {c["name"] for c in inspect(st.engine).get_columns("serve_requests")}
        with st.engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM serve_requests")).scalar() == 3


def test_cli_from_another_directory(tmp_path):
    """``script_location`` is a package path: the command works from any working directory."""
    db = f"sqlite:///{tmp_path}/x.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.run([sys.executable, "-m", "cluster.results.store", "upgrade", "--db", db], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    cur = subprocess.run([sys.executable, "-m", "cluster.results.store", "current", "--db", db], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert (cur.returncode, cur.stdout.strip()) == (0, "0004 (head)"), cur.stderr


@pytest.mark.parametrize("url", ["results.db", "nosuchdialect://x/y", "postgresql+asyncpg://u@h/db", ""])
@pytest.mark.parametrize("cmd", ["upgrade", "current"])
def test_cli_bad_url_exits_2(cmd, url, capsys):
    assert main([cmd, "--db", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "sqlite:///" in err


def test_cli_current_does_not_create_and_masks_passwords(tmp_path, capsys):
    missing = tmp_path / "none" / "x.db"
    assert main(["current", "--db", f"sqlite:///{missing}"]) == 1
    assert "no database" in capsys.readouterr().err and not missing.parent.exists()
    assert main(["upgrade", "--db", "postgresql+psycopg://user:hunter2@127.0.0.1:1/db"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "hunter2" not in err


# ------------------------------------------------------------------ concurrent writers
N_OWN, N_SHARED = 6, 4


def _writer(url: str, i: int, barrier, queue) -> None:
    """One process: open the (new) database at the same moment as the others, then write its own
    rows and rows every process writes (the same keys)."""
    try:
        barrier.wait(120)
        st = open_store(url)  # every process migrates-or-finds-migrated at once
        st.start_run(f"w{i}", benchmark="ruler", model="m", methods=["sparsespec-l"], config={})
        if i == 0:
            st.start_run("shared", benchmark="ruler", model="m", methods=["sparsespec-l"], config={})
        barrier.wait(120)
        own = shared = 0
        for j in range(N_OWN):
            own += st.add_results([_row(run_id=f"w{i}", sample_id=f"s{j}", trace=[[2, j % 3], [1, 1]])])
            if j < N_SHARED:
                shared += st.add_results([_row(run_id="shared", sample_id=f"s{j}", trace=[[3, j % 4], [3, 3]])])
        st.start_shard(f"w{i}", "k", task="t", sample_ids=["x"])
        own += st.complete_shard(f"w{i}", "k", [_row(run_id=f"w{i}", sample_id="x", trace=[[1, 0]])])
        st.close()
        queue.put((i, own, shared, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((i, 0, 0, f"{type(e).__name__}: {e}"))


def test_concurrent_writers_on_a_new_database(db_url):
    n = 4
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db_url, i, barrier, queue)) for i in range(n)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=300) for _ in range(n)]
    for p in procs:
        p.join(60)
    assert [err for *_, err in got] == [None] * n, got
    assert all(own == N_OWN + 1 for _, own, _, _ in got), got
    assert sum(shared for _, _, shared, _ in got) == N_SHARED, "each shared row inserted by exactly one process"
    with open_store(db_url, create=False) as st:
        assert st.revision() == head_revision()
        rows = st.results()
        keys = [(r["run_id"], r["sample_id"]) for r in rows]
        assert len(keys) == len(set(keys)) == n * (N_OWN + 1) + N_SHARED
        steps = st.acceptance_steps()
        assert len(steps) == n * (2 * N_OWN + 1) + 2 * N_SHARED  # one trace per stored row, never two
        per = {}
        for s in steps:
            per.setdefault((s["run_id"], s["sample_id"]), []).append((s["step"], s["k"], s["accepted"]))
        assert per[("shared", "s1")] == [(0, 3, 1), (1, 3, 3)]
        assert per[("w2", "s4")] == [(0, 2, 1), (1, 1, 1)] and per[("w3", "x")] == [(0, 1, 0)]


# ------------------------------------------------------------------ acceptance trace
def test_step_trace_round_trip(db_url):
    with open_store(db_url) as st:
        st.start_run("r1", benchmark="ruler", model="m", methods=["ar", "sparsespec-l"],
                     config={"context_length": 4096, "batch_size": 2})
        st.start_run("r2", benchmark="ruler", model="m", methods=["sparsespec-l"], config={})
        rows = [
            _row(method="ar", trace=[]),  # AR: no trace rows
            _row(trace=[[4, 2], [0, 0], [4, 4], (3, 1)]),
            _row(task="t2", sample_id="s9", trace=[[2, 2]]),
            _row(run_id="r2", trace=[[1, 0]]),
        ]
        assert st.add_results(rows) == 4
        assert rows[1]["stats"]["step_trace"][0] == [4, 2], "the caller's row is not changed"
        assert all("step_trace" not in r["stats"] for r in st.results())
        got = st.acceptance_steps("r1")
        assert [tuple(r) for r in got] == [ACCEPTANCE_STEP_FIELDS] * 5
        assert [(r["task"], r["sample_id"], r["method"], r["step"], r["k"], r["accepted"]) for r in got] == [
            ("t", "s1", "sparsespec-l", 0, 4, 2), ("t", "s1", "sparsespec-l", 1, 0, 0),
            ("t", "s1", "sparsespec-l", 2, 4, 4), ("t", "s1", "sparsespec-l", 3, 3, 1),
            ("t2", "s9", "sparsespec-l", 0, 2, 2)]
        assert {(r["run_id"], r["benchmark"], r["model"], r["context_length"], r["batch_size"]) for r in got} == {
            ("r1", "ruler", "m", 4096, 2)}
        assert [(r["run_id"], r["context_length"], r["batch_size"]) for r in st.acceptance_steps(["r2"])] == [
            ("r2", None, 1)]
        assert len(st.acceptance_steps()) == 6 and st.acceptance_steps("other") == []
        # a duplicate result (even with another trace) stores nothing
        assert st.add_results([_row(trace=[[9, 9]]), _row(method="ar", trace=[[1, 1]])]) == 0
        assert len(st.acceptance_steps()) == 6
        # complete_shard stores the trace in the same transaction; a failed one stores none
        st.start_shard("r2", "r2/t/0", task="t", sample_ids=["s5"])
        with pytest.raises(Exception):
            st.complete_shard("r2", "r2/t/0", [_row(run_id="r2", sample_id="s5", trace=[[2, 1]]),
                                               _row(run_id="missing-run", sample_id="s6", trace=[[2, 2]])])
        assert len(st.acceptance_steps("r2")) == 1
        assert st.complete_shard("r2", "r2/t/0", [_row(run_id="r2", sample_id="s5", trace=[[2, 1]]),
                                                  _row(run_id="r2", trace=[[5, 5]])]) == 1
        assert [(r["sample_id"], r["k"]) for r in st.acceptance_steps("r2")] == [("s1", 1), ("s5", 2)]
        # a trace goes with its result
        with st.engine.begin() as c:
            c.execute(delete(Result).where(Result.run_id == "r1", Result.task == "t2"))
        assert len(st.acceptance_steps("r1")) == 4
        with pytest.raises(ValueError, match="step_trace"):
            st.add_results([_row(sample_id="bad", trace=[[1, 2, 3]])])
        with pytest.raises(ValueError, match="step_trace"):
            st.add_results([_row(sample_id="bad", trace=[[-1, 0]])])
