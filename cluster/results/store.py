"""Result store: SQLAlchemy 2.x ORM over SQLite or PostgreSQL.

Tables:

``runs``
    One row per resolved configuration. ``run_id`` is a deterministic hash of that configuration
    (see :func:`cluster.sweep.coordinator.compute_run_id`), so rerunning the same configuration resumes
    the same run instead of starting a new one.

``shards``
    One row per planned shard (a batch of samples run with every method): status, attempts, the
    last error and worker. A shard's results and its ``done`` status are written together.

``results``
    One row per (run, task, sample, method) generation, carrying raw counts and seconds
    (``stats``), never derived ratios: those are computed when read (``cluster.results.report``).
    ``UNIQUE(run_id, task, sample_id, method)`` makes writes idempotent.

``acceptance_steps``
    One row per verify step of a stored result: ``step`` (0-based), ``k`` (draft tokens proposed
    and counted in that step; 0 = it drafted nothing) and ``accepted``. Written from the
    ``step_trace`` of a result's stats (popped out of ``results.stats``) in the same transaction
    as the result row; AR rows have none. ``UNIQUE(result_id, step)``; deleting the result (or its
    run) deletes them.

``serve_requests``
    One row per request the Serve A/B endpoint (``cluster.serve.endpoint``) answered or refused: arm,
    method, session, token counts, latencies in seconds, acceptance counts, finish reason,
    status and error. ``request_id`` is unique, so a re-sent batch is not stored twice.

``run_id_map``
    Run ids rewritten by a migration (revision 0003, when run ids came to hash only each
    method's own options): old id, new id, the run's old config and a note. ``cluster.sweep.run``
    resumes a store written before it under the new ids.

``alembic_version``
    The schema revision (Alembic, ``cluster/results/migrations``). ``open_store(create=True)`` upgrades
    to the newest revision under a lock (a file lock beside a SQLite file, an advisory lock on
    PostgreSQL), so concurrent writers opening a new database are safe; a database made before
    migrations existed (tables, no ``alembic_version``) is stamped ``0001`` and upgraded, its rows
    kept. Readers (``create=False``) never migrate: tables an older schema lacks read as empty.
    By hand: ``python -m cluster.results.store upgrade --db URL`` and ``python -m cluster.results.store current
    --db URL``.

A sweep writes through one object, :class:`SweepRecorder` (its runs, and the shard events of
``cluster.results.events`` that the coordinator hands back); nothing in ``cluster.sweep`` calls a
store write itself.

The same code runs against ``sqlite:///path.db`` and ``postgresql+psycopg://user@host/db``.
Only this module and its callers import SQLAlchemy; ``sparsespec`` and ``evals`` never do.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import logging
import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy import false as sa_false
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from cluster.results.events import (UNAVAILABLE_EVENT, ShardDone, ShardEvent, ShardFailed, ShardStarted,
                                    WorkersReady)

log = logging.getLogger(__name__)

DEFAULT_DB_URL = "sqlite:///results/sparsespec.db"

# JSON on SQLite, JSONB on PostgreSQL (indexable, compact).
JSONType = JSON().with_variant(JSONB(), "postgresql")

#: Column names of ``results`` that a caller supplies (``id`` and ``created_at`` are filled in).
RESULT_FIELDS = (
    "run_id",
    "benchmark",
    "task",
    "model",
    "method",
    "sample_id",
    "prediction",
    "token_ids",
    "score",
    "stats",
    "lossless",
    "first_divergence",
    "num_input_tokens_raw",
    "num_input_tokens",
    "references",
)


class StoreError(RuntimeError):
    """Any failure to open or use the result store, with the (password-masked) URL in the text."""


class StoreURLError(StoreError, ValueError):
    """The database URL cannot be parsed or names a driver that is not installed."""


class StoreNotFoundError(StoreError):
    """Opened for reading, but the SQLite file does not exist."""


def cli_error(e: StoreError) -> int:
    """A command line's answer to a store error: the message on stderr, and the exit status
    (2: the URL itself is bad; 1: the database is missing or cannot be used)."""
    print(f"error: {e}", file=sys.stderr)
    return 2 if isinstance(e, StoreURLError) else 1


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    benchmark: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(256))
    methods: Mapped[list] = mapped_column(JSONType)  # ["ar", "sparsespec-l", ...]
    config: Mapped[dict] = mapped_column(JSONType)  # the resolved configuration that was hashed
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="running")  # running|finished|failed|interrupted
    host: Mapped[dict | None] = mapped_column(JSONType, nullable=True)  # driver + worker host info
    events: Mapped[list | None] = mapped_column(JSONType, nullable=True)  # worker deaths, retries, errors


class Result(Base):
    __tablename__ = "results"
    __table_args__ = (
        UniqueConstraint("run_id", "task", "sample_id", "method", name="uq_results_run_task_sample_method"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id", ondelete="CASCADE"), index=True)
    benchmark: Mapped[str] = mapped_column(String(64))
    task: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    method: Mapped[str] = mapped_column(String(64))
    sample_id: Mapped[str] = mapped_column(String(256))
    prediction: Mapped[str] = mapped_column(Text, default="")
    token_ids: Mapped[list] = mapped_column(JSONType)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    stats: Mapped[dict] = mapped_column(JSONType)
    # None = not applicable (the AR row itself, sampling runs) or inconclusive (zero drafted tokens)
    lossless: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    first_divergence: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_input_tokens_raw: Mapped[int] = mapped_column(Integer)
    num_input_tokens: Mapped[int] = mapped_column(Integer)
    # "references" is an SQL keyword; SQLAlchemy quotes it on every dialect.
    references: Mapped[list] = mapped_column("references", JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ShardRow(Base):
    """One planned shard of a run (a batch of samples, every method): its status across attempts.

    ``status``: ``running`` (a worker has it), ``done`` (its results are stored, written in the
    same transaction), ``failed`` (gave up after its retries; ``error`` says why). Resume skips
    ``done`` shards and retries the others. ``key`` is the planner's stable shard key.
    """

    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("run_id", "key", name="uq_shards_run_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id", ondelete="CASCADE"), index=True)
    key: Mapped[str] = mapped_column(String(512))
    task: Mapped[str] = mapped_column(String(128))
    sample_ids: Mapped[list] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(16), default="running")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker: Mapped[dict | None] = mapped_column(JSONType, nullable=True)  # pid, host, node of the last attempt
    wall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class BenchRow(Base):
    """One measurement of ``python -m cluster.speed``: a step-timing row (``kind="steps"``), an
    end-to-end row per method (``"e2e"``) or the transformers reference (``"hf"``). The numbers
    (seconds, bytes, roofline multiples) live in ``metrics``; ``(run_id, kind, context_len,
    batch_size, method)`` is unique, so re-storing a run is idempotent."""

    __tablename__ = "bench"
    __table_args__ = (UniqueConstraint("run_id", "kind", "context_len", "batch_size", "method"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(256))
    device: Mapped[str] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(16))
    context_len: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(64))
    metrics: Mapped[dict] = mapped_column(JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ServeRequest(Base):
    """One request of the Serve A/B endpoint (``cluster.serve.endpoint``): counts and seconds only (the
    dashboard's A/B view derives TPOT ratios and percentiles from them). Requests refused before
    reaching an arm (4xx, 401, 503) have no arm and ``status`` = the HTTP status."""

    __tablename__ = "serve_requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    experiment: Mapped[str] = mapped_column(String(128), index=True)
    model: Mapped[str] = mapped_column(String(256))
    arm: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    method: Mapped[str | None] = mapped_column(String(64), nullable=True)
    session: Mapped[str | None] = mapped_column(String(256), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(32))  # "completions" | "chat.completions"
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[int] = mapped_column(Integer)  # HTTP status answered (499: client went away)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    output_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    temperature: Mapped[float | None] = mapped_column(Float, nullable=True)
    queue_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # arrival at the arm -> admitted
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    e2el_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # counts and seconds of the engine (``sparsespec.stats`` keys) plus the chunk gaps
    stats: Mapped[dict | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    # a client's warm-up request (``cluster.results.ab.WARMUP_HEADER``; revision 0004): stored, left
    # out of ``Store.serve_requests`` unless asked for. No Python-side default: an insert that
    # does not name it leaves it to the database (and works on a schema from before 0004)
    warmup: Mapped[bool] = mapped_column(Boolean, server_default=sa_false())


class AcceptanceStep(Base):
    """One verify step of a stored result (revision 0002): ``k`` draft tokens proposed and counted
    in it (0: the step drafted nothing), ``accepted`` of them accepted. ``step`` is 0-based, in
    the request's order; a result's steps come from its stats' ``step_trace``."""

    __tablename__ = "acceptance_steps"
    __table_args__ = (UniqueConstraint("result_id", "step", name="uq_acceptance_steps_result_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    result_id: Mapped[int] = mapped_column(Integer, ForeignKey("results.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)


class RunIdMap(Base):
    """A run id a migration rewrote (revision 0003: run ids hash each method's own options):
    ``old_run_id`` -> ``new_run_id`` (equal when the run kept its id; ``note`` says why), the
    run's config before the migration, and the revision that did it."""

    __tablename__ = "run_id_map"

    old_run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    new_run_id: Mapped[str] = mapped_column(String(64), index=True)
    revision: Mapped[str] = mapped_column(String(32))
    old_config: Mapped[dict] = mapped_column(JSONType)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)


#: Keys of each row ``Store.acceptance_steps`` returns.
ACCEPTANCE_STEP_FIELDS = ("run_id", "benchmark", "task", "model", "method", "sample_id", "context_length",
                          "batch_size", "step", "k", "accepted")

#: Columns of ``serve_requests`` a caller supplies.
SERVE_REQUEST_FIELDS = tuple(c.name for c in ServeRequest.__table__.columns if c.name != "id")


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as None and tuples as lists (PostgreSQL's JSONB rejects
    NaN and Infinity; SQLite would store them as invalid JSON)."""
    import math

    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _result_to_dict(r: Result) -> dict[str, Any]:
    d = {name: getattr(r, name) for name in RESULT_FIELDS}
    d["id"] = r.id
    d["created_at"] = r.created_at
    return d


def _run_to_dict(r: Run) -> dict[str, Any]:
    return {
        "run_id": r.run_id,
        "benchmark": r.benchmark,
        "model": r.model,
        "methods": list(r.methods or []),
        "config": dict(r.config or {}),
        "created_at": r.created_at,
        "finished_at": r.finished_at,
        "status": r.status,
        "host": r.host,
        "events": list(r.events or []),
    }


def safe_url(url: str | URL) -> str:
    """The URL as text with any password masked (for messages and logs)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only used for messages
        return "<unparseable database URL>"


def _parse_url(url: str | URL) -> URL:
    if not isinstance(url, URL) and (not isinstance(url, str) or not url.strip()):
        raise StoreURLError(
            f"database URL must be a non-empty string, got {url!r}; expected e.g. "
            f"sqlite:///results/sparsespec.db or postgresql+psycopg://user:password@host:5432/dbname"
        )
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        hint = ""
        if isinstance(url, str) and "://" not in url:
            hint = f" (did you mean sqlite:///{url} ?)"
        raise StoreURLError(
            f"cannot parse database URL {url!r}{hint}; expected e.g. sqlite:///results/sparsespec.db "
            f"or postgresql+psycopg://user:password@host:5432/dbname"
        ) from e
    return parsed


def _sqlite_path(url: URL) -> Path | None:
    """Filesystem path of a file-backed SQLite URL, else None (memory DB, other dialects)."""
    if url.get_backend_name() != "sqlite":
        return None
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def _clean_trace(trace: Any, row: Mapping[str, Any]) -> list[tuple[int, int]]:
    """A result's ``step_trace`` as ``[(k, accepted), ...]`` of non-negative ints (ValueError
    naming the row otherwise); None or empty: ``[]``."""
    if not trace:
        return []
    out = []
    try:
        for k, a in trace:
            k, a = int(k), int(a)
            if k < 0 or a < 0:
                raise ValueError("negative")
            out.append((k, a))
    except (TypeError, ValueError) as e:
        raise ValueError(f"result {row.get('run_id')}/{row.get('task')}/{row.get('sample_id')}/{row.get('method')}: "
                         f"stats.step_trace must be [[k, accepted], ...] of non-negative ints ({e}): "
                         f"{trace!r:.200}") from e
    return out


class Store:
    """Handle on one database: runs and results, idempotent writes, plain-dict reads."""

    def __init__(self, engine: Engine, *, has_tables: bool = True) -> None:
        self.engine = engine
        self._session = sessionmaker(engine, expire_on_commit=False)
        self._has_tables = has_tables
        self._trace_table: bool | None = None  # acceptance_steps exists (checked on first write)

    @property
    def url(self) -> str:
        return safe_url(self.engine.url)

    @property
    def has_tables(self) -> bool:
        return self._has_tables

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- runs
    def start_run(
        self,
        run_id: str,
        *,
        benchmark: str,
        model: str,
        methods: Sequence[str],
        config: Mapping[str, Any],
        host: Mapping[str, Any] | None = None,
    ) -> bool:
        """Create the run row, or mark an existing one as running again (resume).

        Returns True if the run is new. ``created_at`` of a resumed run is kept.
        """
        with self._session.begin() as s:
            run = s.get(Run, run_id)
            if run is None:
                s.add(
                    Run(
                        run_id=run_id,
                        benchmark=benchmark,
                        model=model,
                        methods=list(methods),
                        config=dict(config),
                        status="running",
                        host=dict(host) if host else None,
                        events=[],
                    )
                )
                return True
            run.status = "running"
            run.finished_at = None
            if host:
                run.host = dict(host)
            return False

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of a run (``status``, ``finished_at``, ``host``)."""
        allowed = {"status", "finished_at", "host"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"update_run: cannot set {sorted(bad)}; allowed: {sorted(allowed)}")
        with self._session.begin() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise StoreError(f"no run {run_id!r} in {self.url}")
            for k, v in fields.items():
                setattr(run, k, v)

    def finish_run(self, run_id: str, status: str = "finished") -> None:
        self.update_run(run_id, status=status, finished_at=utcnow())

    def record_event(self, run_id: str, message: str, **extra: Any) -> None:
        """Append an event (worker death, retry, failure) to the run's ``events`` list."""
        entry = {"at": utcnow().isoformat(), "message": message, **extra}
        with self._session.begin() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise StoreError(f"no run {run_id!r} in {self.url}")
            run.events = [*(run.events or []), entry]  # reassign: JSON columns do not track mutation

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        if not self._has_tables:
            return None
        with self._session() as s:
            run = s.get(Run, run_id)
            return _run_to_dict(run) if run else None

    def runs(self) -> list[dict[str, Any]]:
        """All runs, newest first, each with ``num_results``."""
        if not self._has_tables:
            return []
        with self._session() as s:
            counts = dict(s.execute(select(Result.run_id, func.count(Result.id)).group_by(Result.run_id)).all())
            rows = s.scalars(select(Run).order_by(Run.created_at.desc(), Run.run_id)).all()
            out = []
            for r in rows:
                d = _run_to_dict(r)
                d["num_results"] = int(counts.get(r.run_id, 0))
                out.append(d)
            return out

    def run_id_map(self) -> dict[str, str]:
        """``{old run id: new run id}`` of the runs a migration moved to a new id (``run_id_map``;
        runs that kept theirs are left out; ``{}`` for a schema before revision 0003)."""
        if not self._has_tables or "run_id_map" not in inspect(self.engine).get_table_names():
            return {}
        with self._session() as s:
            rows = s.execute(select(RunIdMap.old_run_id, RunIdMap.new_run_id)).all()
            return {old: new for old, new in rows if old != new}

    # -------------------------------------------------------------- results
    def add_results(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Insert result rows in one transaction; rows whose unique key exists are ignored.

        Returns the number of rows actually inserted.
        """
        clean = [self._clean_result(r) for r in rows]  # (row, step_trace) pairs
        if not clean:
            return 0
        with self._session.begin() as s:
            return self._insert_results(s, clean)

    def _insert_results(self, s: Any, clean: Sequence[tuple[Mapping[str, Any], list[tuple[int, int]]]]) -> int:
        """Insert ``(row, step_trace)`` pairs from ``_clean_result``; a row whose unique key exists
        is skipped with its trace. The traces of inserted rows go to ``acceptance_steps`` in the
        same transaction. Returns the number of result rows inserted."""
        dialect = self.engine.dialect.name
        key = ["run_id", "task", "sample_id", "method"]
        inserted = 0
        traced: list[tuple[int, list[tuple[int, int]]]] = []
        if dialect in ("sqlite", "postgresql"):
            ins = sqlite_insert if dialect == "sqlite" else pg_insert
            table = Result.__table__
            for row, trace in clean:
                stmt = (ins(table).values(**row).on_conflict_do_nothing(index_elements=key)
                        .returning(table.c.id))  # rowcount is -1 on psycopg 3: count RETURNING rows
                ids = s.execute(stmt).scalars().all()
                inserted += len(ids)
                if ids and trace:
                    traced.append((int(ids[0]), trace))
        else:  # any other dialect: check-then-insert inside the transaction
            for row, trace in clean:
                exists = s.scalar(select(Result.id).where(*(getattr(Result, k) == row[k] for k in key)).limit(1))
                if exists is None:
                    obj = Result(**row)
                    s.add(obj)
                    s.flush()
                    inserted += 1
                    if trace:
                        traced.append((int(obj.id), trace))
        if traced and self._can_trace(s):
            s.execute(insert(AcceptanceStep.__table__), [
                {"result_id": rid, "step": i, "k": k, "accepted": a}
                for rid, trace in traced for i, (k, a) in enumerate(trace)])
        return inserted

    def _can_trace(self, s: Any) -> bool:
        """Whether ``acceptance_steps`` exists (always after ``open_store(create=True)``; a store
        opened read-only on an older schema stores no traces instead of failing)."""
        if self._trace_table is None:
            self._trace_table = inspect(s.connection()).has_table(AcceptanceStep.__tablename__)
            if not self._trace_table:
                log.warning("%s has no acceptance_steps table (schema before revision 0002): step traces "
                            "are not stored; run python -m cluster.results.store upgrade --db URL", self.url)
        return self._trace_table

    # --------------------------------------------------------------- shards
    def _shard(self, s: Any, run_id: str, key: str, task: str, sample_ids: Sequence[str]) -> ShardRow:
        row = s.scalars(select(ShardRow).filter_by(run_id=run_id, key=key)).first()
        if row is None:
            row = ShardRow(run_id=run_id, key=key, task=task, sample_ids=list(sample_ids), status="pending",
                           attempts=0)
            s.add(row)
        return row

    def start_shard(self, run_id: str, key: str, *, task: str, sample_ids: Sequence[str],
                    worker: Mapping[str, Any] | None = None) -> int:
        """Mark a shard as running (one more attempt); returns the attempt number (1-based)."""
        with self._session.begin() as s:
            row = self._shard(s, run_id, key, task, sample_ids)
            if row.status == "done":
                raise StoreError(f"shard {key!r} of run {run_id} is already done")
            row.status, row.attempts = "running", int(row.attempts or 0) + 1
            row.worker, row.started_at, row.finished_at = json_safe(dict(worker or {})), utcnow(), None
            return row.attempts

    def complete_shard(self, run_id: str, key: str, results: Iterable[Mapping[str, Any]], *,
                       wall_s: float | None = None, worker: Mapping[str, Any] | None = None) -> int:
        """Store a shard's results and mark it done, in ONE transaction (a crash leaves neither).

        Returns the number of result rows inserted (existing (run, task, sample, method) rows are
        never written twice). Raises StoreError if the shard was never started.
        """
        clean = [self._clean_result(r) for r in results]  # (row, step_trace) pairs
        with self._session.begin() as s:
            row = s.scalars(select(ShardRow).filter_by(run_id=run_id, key=key)).first()
            if row is None:
                raise StoreError(f"complete_shard: shard {key!r} of run {run_id} was never started")
            n = self._insert_results(s, clean)
            row.status, row.error, row.finished_at = "done", None, utcnow()
            row.wall_s = None if wall_s is None else float(wall_s)
            if worker:
                row.worker = json_safe(dict(worker))
            return n

    def fail_shard(self, run_id: str, key: str, error: str, *, final: bool) -> None:
        """Record a failed attempt; ``final``: no more retries (status ``failed``), else back to
        ``pending``."""
        with self._session.begin() as s:
            row = s.scalars(select(ShardRow).filter_by(run_id=run_id, key=key)).first()
            if row is None:
                raise StoreError(f"fail_shard: shard {key!r} of run {run_id} was never started")
            if row.status == "done":
                return
            row.status = "failed" if final else "pending"
            row.error, row.finished_at = str(error)[:4000], utcnow()

    def release_running(self, run_id: str) -> int:
        """Shards left ``running`` (interrupted sweep): back to ``pending``. Returns how many."""
        with self._session.begin() as s:
            rows = s.scalars(select(ShardRow).filter_by(run_id=run_id, status="running")).all()
            for r in rows:
                r.status = "pending"
            return len(rows)

    def shards(self, run_id: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Shard rows as plain dicts (all runs, or some), in planning order."""
        if not self._has_tables or not inspect(self.engine).has_table("shards"):
            return []
        q = select(ShardRow).order_by(ShardRow.id)
        if run_id is not None:
            ids = [run_id] if isinstance(run_id, str) else list(run_id)
            q = q.where(ShardRow.run_id.in_(ids))
        with self._session() as s:
            return [{c: getattr(r, c) for c in ("run_id", "key", "task", "sample_ids", "status", "attempts",
                                                 "error", "worker", "wall_s", "started_at", "finished_at")}
                    for r in s.scalars(q)]

    def done_shards(self, run_id: str) -> set[str]:
        """Keys of the shards of ``run_id`` whose results are stored."""
        return {r["key"] for r in self.shards(run_id) if r["status"] == "done"}

    @staticmethod
    def _clean_result(row: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[int, int]]]:
        """The row's ``results`` columns, and the ``step_trace`` popped out of its stats (one
        ``(k, accepted)`` per verify step; empty when absent)."""
        missing = [k for k in ("run_id", "benchmark", "task", "model", "method", "sample_id") if row.get(k) is None]
        if missing:
            raise ValueError(f"result row lacks {missing}: {dict(row)!r:.300}")
        out = {k: row.get(k) for k in RESULT_FIELDS}
        out["sample_id"] = str(out["sample_id"])
        out["prediction"] = out["prediction"] or ""
        out["token_ids"] = [int(t) for t in (out["token_ids"] or [])]
        out["stats"] = dict(out["stats"] or {})
        trace = _clean_trace(out["stats"].pop("step_trace", None), out)
        out["references"] = list(out["references"] or [])
        out["num_input_tokens_raw"] = int(out["num_input_tokens_raw"] or 0)
        out["num_input_tokens"] = int(out["num_input_tokens"] or 0)
        if out["score"] is not None:
            out["score"] = float(out["score"])
        if out["lossless"] is not None:
            out["lossless"] = bool(out["lossless"])
        if out["first_divergence"] is not None:
            out["first_divergence"] = int(out["first_divergence"])
        out["created_at"] = utcnow()
        return out, trace

    # ----------------------------------------------------------------- bench
    def add_bench_rows(self, run_id: str, model: str, device: str, rows: Iterable[Mapping[str, Any]]) -> int:
        """Store ``cluster.speed.measure`` rows (each with ``kind``, ``context_len``, ``batch_size`` and
        optionally ``method``); an existing (run, kind, context, batch, method) row is replaced."""
        n = 0
        with self._session.begin() as s:
            for row in rows:
                key = dict(run_id=run_id, kind=str(row["kind"]), context_len=int(row["context_len"]),
                           batch_size=int(row["batch_size"]), method=str(row.get("method") or ""))
                old = s.scalars(select(BenchRow).filter_by(**key)).first()
                if old is not None:
                    s.delete(old)
                    s.flush()
                s.add(BenchRow(model=model, device=device, metrics=json_safe(dict(row)), **key))
                n += 1
        return n

    # ----------------------------------------------------------------- serve requests
    def add_serve_requests(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Store Serve request rows (keys of ``SERVE_REQUEST_FIELDS``; unknown keys are an
        error); a ``request_id`` already stored is skipped. Returns the rows inserted."""
        clean = []
        for row in rows:
            unknown = set(row) - set(SERVE_REQUEST_FIELDS)
            if unknown:
                raise ValueError(f"serve request row: unknown fields {sorted(unknown)}")
            d = {k: json_safe(v) for k, v in row.items()}
            d.setdefault("created_at", utcnow())
            clean.append(d)
        if not clean:
            return 0
        ins = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        with self._session.begin() as s:
            n = 0
            for d in clean:  # one statement per row: rows may carry different optional columns
                stmt = ins(ServeRequest).values(**d).on_conflict_do_nothing(index_elements=["request_id"])
                n += len(s.execute(stmt.returning(ServeRequest.id)).all())  # rowcount is -1 on psycopg
        return n

    def serve_requests(self, experiment: str | None = None, *, warmups: bool = False) -> list[dict[str, Any]]:
        """Stored Serve requests (all experiments, or one), oldest first, as plain dicts; warm-up
        requests (``warmup`` true: the client marked them) only with ``warmups=True``, so every
        A/B view counts the requests the load test measured. A reader on a store from before
        revision 0004 (readers never migrate) sees ``warmup`` false on every row."""
        if not self._has_tables or not inspect(self.engine).has_table("serve_requests"):
            return []
        stored = {c["name"] for c in inspect(self.engine).get_columns("serve_requests")}
        table = ServeRequest.__table__
        names = [c for c in ("id", *SERVE_REQUEST_FIELDS) if c in stored]
        q = select(*(table.c[c] for c in names)).order_by(table.c.id)
        if experiment is not None:
            q = q.where(table.c.experiment == experiment)
        if not warmups and "warmup" in stored:
            q = q.where(table.c.warmup.is_(False))
        with self._session() as s:
            return [{"warmup": False, **dict(r._mapping)} for r in s.execute(q)]

    def bench_rows(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Stored bench rows (all runs, or one), oldest first, as plain dicts."""
        if not self._has_tables or not inspect(self.engine).has_table("bench"):
            return []
        q = select(BenchRow).order_by(BenchRow.id)
        if run_id is not None:
            q = q.where(BenchRow.run_id == run_id)
        with self._session() as s:
            return [{"run_id": r.run_id, "model": r.model, "device": r.device, **dict(r.metrics)}
                    for r in s.scalars(q)]

    def done_keys(self, run_id: str) -> set[tuple[str, str, str]]:
        """(task, sample_id, method) already stored for this run."""
        if not self._has_tables:
            return set()
        with self._session() as s:
            rows = s.execute(
                select(Result.task, Result.sample_id, Result.method).where(Result.run_id == run_id)
            ).all()
            return {(t, sid, m) for t, sid, m in rows}

    def results(
        self,
        run_ids: str | Iterable[str] | None = None,
        *,
        method: str | None = None,
        task: str | None = None,
    ) -> list[dict[str, Any]]:
        """Result rows as plain dicts (all columns, plus the run's ``context_length``,
        ``batch_size``, ``queue_depth`` (1: static batches) and ``quantize`` (the target's
        weights: ``"none"`` or ``"int8"``) from its config), optionally filtered, in insertion
        order."""
        if not self._has_tables:
            return []
        stmt = select(Result).order_by(Result.id)
        if run_ids is not None:
            ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
            stmt = stmt.where(Result.run_id.in_(ids))
        if method is not None:
            stmt = stmt.where(Result.method == method)
        if task is not None:
            stmt = stmt.where(Result.task == task)
        with self._session() as s:
            out = [_result_to_dict(r) for r in s.scalars(stmt).all()]
            cfg = dict(s.execute(select(Run.run_id, Run.config).where(
                Run.run_id.in_({r["run_id"] for r in out}))).all())
        for r in out:  # the cell of the run (a sweep's context length and batch size)
            c = cfg.get(r["run_id"]) or {}
            r["context_length"] = c.get("context_length")
            r["batch_size"] = int(c.get("batch_size") or 1)
            r["queue_depth"] = int(c.get("queue_depth") or 1)  # 1: static batches (cluster.sweep.schema)
            r["quantize"] = str(c.get("quantize") or "none")
            r["repetition"] = int(c.get("repetition") or 0)
        return out

    def acceptance_steps(self, run_ids: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The per-step acceptance trace of stored results (all runs, or some): one dict per verify
        step with ``ACCEPTANCE_STEP_FIELDS`` (the result's keys, its run's ``context_length`` and
        ``batch_size`` as in ``results``, then ``step``, ``k``, ``accepted``), ordered by result
        then step. Empty when the table does not exist (an older database opened read-only)."""
        if not self._has_tables or not inspect(self.engine).has_table(AcceptanceStep.__tablename__):
            return []
        stmt = (select(Result.run_id, Result.benchmark, Result.task, Result.model, Result.method, Result.sample_id,
                       AcceptanceStep.step, AcceptanceStep.k, AcceptanceStep.accepted)
                .join(AcceptanceStep, AcceptanceStep.result_id == Result.id)
                .order_by(Result.id, AcceptanceStep.step))
        if run_ids is not None:
            ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
            stmt = stmt.where(Result.run_id.in_(ids))
        with self._session() as s:
            rows = s.execute(stmt).all()
            cfg = dict(s.execute(select(Run.run_id, Run.config).where(
                Run.run_id.in_({r.run_id for r in rows}))).all()) if rows else {}
        out = []
        for r in rows:
            c = cfg.get(r.run_id) or {}
            out.append({"run_id": r.run_id, "benchmark": r.benchmark, "task": r.task, "model": r.model,
                        "method": r.method, "sample_id": r.sample_id, "context_length": c.get("context_length"),
                        "batch_size": int(c.get("batch_size") or 1), "step": int(r.step), "k": int(r.k),
                        "accepted": int(r.accepted)})
        return out

    def revision(self) -> str | None:
        """The database's schema revision (``alembic_version``; None before migrations)."""
        return current_revision(self.engine)

    def token_ids(self, run_id: str, method: str) -> dict[tuple[str, str], list[int]]:
        """{(task, sample_id): token_ids} of one method in one run (used to check losslessness)."""
        if not self._has_tables:
            return {}
        with self._session() as s:
            rows = s.execute(
                select(Result.task, Result.sample_id, Result.token_ids).where(
                    Result.run_id == run_id, Result.method == method
                )
            ).all()
            return {(t, sid): list(tok) for t, sid, tok in rows}


# ------------------------------------------------------------------ schema migrations (Alembic)
#: Where the revisions live, as a package path (works from any working directory and installed).
MIGRATIONS = "cluster.results:migrations"
# --------------------------------------------------------------------------- the sweep's writer
@dataclass
class SweepRecorder:
    """The one place a sweep writes to the store: its runs (started or resumed, their workers,
    finished) and every event the coordinator hands back (``cluster.results.events``: workers
    ready, shard started, done with its rows, failed). ``tests/test_layering.py`` checks that no
    code in ``cluster.sweep`` calls a store write.

    ``cells``: the sweep's planned runs (``cluster.sweep.plan.Cell``: ``run_id``, ``benchmark``,
    ``model``, ``quantize``, ``config``, ...). ``prov``: the runs' provenance, stored with each run
    at :meth:`start_runs` and again, with the workers' hosts and session, when they are ready."""

    store: Store
    cells: Sequence[Any]
    prov: dict[str, Any] = field(default_factory=dict)
    _unavailable_logged: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def start_runs(self) -> set[str]:
        """Start or resume every cell's run (shards a dead driver left ``running`` go back to
        ``pending``); the keys of the shards already stored."""
        done_keys: set[str] = set()
        for c in self.cells:
            new = self.store.start_run(c.run_id, benchmark=c.benchmark, model=c.model,
                                       methods=list(c.config["methods"]), config=c.config,
                                       host={"provenance": self.prov})
            self.store.release_running(c.run_id)  # a previous driver that died mid-shard
            done_keys |= self.store.done_shards(c.run_id)
            log.info("%s run %s (%s, L=%s, B=%d, rep %d)", "new" if new else "resuming", c.run_id, c.model,
                     c.context_length, c.batch_size, c.repetition)
        return done_keys

    def finish_all(self, status: str) -> None:
        """Every run ends with ``status`` (nothing was left to run); a store error is raised."""
        self.finish({c.run_id: status for c in self.cells}, raise_errors=True)

    def record(self, event: ShardEvent) -> None:
        """Store one event of ``cluster.sweep.coordinator.run_shards``. Raises TypeError for
        anything else."""
        st = self.store
        if isinstance(event, ShardStarted):
            sh = event.shard
            st.start_shard(sh.run_id, sh.key, task=sh.task, sample_ids=[s.sample_id for s in sh.samples],
                           worker=event.worker)
        elif isinstance(event, ShardDone):
            st.complete_shard(event.shard.run_id, event.shard.key, event.rows, wall_s=event.wall_s,
                              worker=event.worker)
            for method, why in sorted(event.unavailable.items()):
                if (event.shard.run_id, method) not in self._unavailable_logged:
                    self._unavailable_logged.add((event.shard.run_id, method))
                    st.record_event(event.shard.run_id, f"{UNAVAILABLE_EVENT}: {method}: {why}",
                                    method=method, unavailable=why, shard=event.shard.key)
        elif isinstance(event, ShardFailed):
            st.fail_shard(event.shard.run_id, event.shard.key, event.error, final=event.final)
            if event.note is not None:
                st.record_event(event.shard.run_id, event.note, shard=event.shard.key)
        elif isinstance(event, WorkersReady):
            self.prov.update(event.session)
            for c in self.cells:
                if c.model == event.model and c.quantize == event.quantize:
                    st.update_run(c.run_id, host={"provenance": self.prov, "workers": event.hosts,
                                                  "devices": event.devices})
        else:
            raise TypeError(f"not a shard event: {event!r}")

    def finish(self, status_of: Mapping[str, str], *, raise_errors: bool = False) -> None:
        """Each run ends with its status, its ``running`` shards back to ``pending``. A store
        error is logged, not raised (the caller may be unwinding another), unless ``raise_errors``."""
        for run_id, status in status_of.items():
            try:
                self.store.release_running(run_id)
                self.store.finish_run(run_id, status=status)
            except Exception:  # noqa: BLE001 - never mask the original error
                if raise_errors:
                    raise
                log.exception("could not mark run %s as %s", run_id, status)


#: The revision of the schema written before migrations existed (``Base.metadata.create_all``).
BASE_REVISION = "0001"
#: Key of the PostgreSQL advisory lock held (for the migration's transaction) while migrating.
PG_MIGRATION_LOCK = zlib.crc32(b"sparsespec cluster.store migrate")
#: Seconds to wait for another process's migration of the same SQLite file.
MIGRATION_LOCK_TIMEOUT_S = 600.0


def alembic_config(connection: Connection | None = None) -> Any:
    """An Alembic ``Config`` for the store's revisions, built in code (no ``alembic.ini``). With
    ``connection``, ``env.py`` migrates through it, inside the caller's transaction."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS)
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def head_revision() -> str:
    """The newest revision this code knows (what ``open_store(create=True)`` upgrades to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "cluster/results/migrations has no revisions"
    return head


def _known_revision(revision: str) -> bool:
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except CommandError:
        return False


def _current_revision(conn: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision; None when it has no ``alembic_version`` (empty, or made
    before migrations)."""
    with _errors_as_store_errors(engine):
        with engine.connect() as conn:
            return _current_revision(conn)


@contextlib.contextmanager
def _errors_as_store_errors(engine: Engine) -> Iterator[None]:
    shown = safe_url(engine.url)
    try:
        yield
    except OperationalError as e:
        raise StoreError(f"cannot open database {shown}: {e.orig}") from e
    except SQLAlchemyError as e:
        raise StoreError(f"cannot open database {shown}: {e}") from e


@contextlib.contextmanager
def _sqlite_migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise migrations of one SQLite file across processes (a lock file beside it)."""
    path = _sqlite_path(engine.url)
    if path is None:  # in-memory: one process by construction
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(str(path.with_name(path.name + ".migrate.lock")), timeout=MIGRATION_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout as e:
        raise StoreError(f"database {safe_url(engine.url)}: another process has been migrating it for "
                         f"{MIGRATION_LOCK_TIMEOUT_S:.0f} s (lock file {lock.lock_file})") from e
    try:
        yield
    finally:
        lock.release()


def _adopt_pre_migration_schema(conn: Connection) -> bool:
    """A database made before migrations (some of revision 0001's tables, no ``alembic_version``):
    create the 0001 tables it lacks (it may predate some of them) and stamp it 0001, keeping its
    rows. Returns whether it was one."""
    from alembic import command
    from alembic.operations import Operations
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    cfg = alembic_config(conn)
    initial = ScriptDirectory.from_config(cfg).get_revision(BASE_REVISION).module
    existing = set(inspect(conn).get_table_names())
    if not existing & set(initial.TABLES):
        return False
    missing = [name for name in initial.TABLES if name not in existing]
    if missing:
        with Operations.context(MigrationContext.configure(conn)):
            for name in missing:
                initial.TABLES[name]()
    command.stamp(cfg, BASE_REVISION)
    log.info("%s: schema from before migrations (created %s); stamped revision %s", safe_url(conn.engine.url),
             ", ".join(missing) or "no table", BASE_REVISION)
    return True


def migrate(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade the database to ``revision`` (default: the newest). Returns ``(before, after)``.

    Safe when several processes open the same database at once: the check and the upgrade run
    in one transaction under a lock (a file lock beside a SQLite file; ``pg_advisory_xact_lock``
    on PostgreSQL), so one process migrates and the others then find it done. A database made
    before migrations is stamped 0001 first (``before`` is then None). Already at the newest
    revision: returns at once without locking. Raises StoreError (e.g. a revision this code does
    not know: a database migrated by a newer version).
    """
    from alembic import command
    from alembic.util import CommandError

    shown = safe_url(engine.url)
    head = head_revision()
    if revision in ("head", head):
        now = current_revision(engine)
        if now == head:
            return now, now
    try:
        with _errors_as_store_errors(engine), _sqlite_migration_lock(engine), engine.connect() as conn:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK})
                before = _current_revision(conn)
                if before is None:
                    _adopt_pre_migration_schema(conn)
                command.upgrade(alembic_config(conn), revision)
                after = _current_revision(conn)
    except CommandError as e:
        raise StoreError(f"cannot migrate database {shown} to {revision!r} (this code knows revisions up to "
                         f"{head!r}; a database upgraded by a newer version?): {e}") from e
    if before != after:
        log.info("%s: schema %s -> %s", shown, before or "none", after)
    return before, after


def _connect(url: str | URL, *, create: bool, echo: bool = False) -> Engine:
    """The engine for ``url`` (nothing is connected yet): StoreURLError for a bad URL or missing
    driver; a SQLite file's folder is created when ``create``, else a missing file is
    StoreNotFoundError."""
    parsed = _parse_url(url)
    shown = safe_url(parsed)
    path = _sqlite_path(parsed)
    if path is not None:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            raise StoreNotFoundError(
                f"no database at {path} (from {shown}); run a benchmark first or pass the right --db URL"
            )
    kwargs: dict[str, Any] = {"echo": echo}
    if parsed.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"timeout": 30}
    else:
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ModuleNotFoundError, ImportError) as e:
        raise StoreURLError(
            f"database URL {shown}: unknown dialect or driver not installed ({e}); "
            f"supported: sqlite:///path.db, postgresql+psycopg://..."
        ) from e
    except ArgumentError as e:
        raise StoreURLError(f"bad database URL {shown}: {e}") from e

    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    return engine


def open_store(url: str | URL = DEFAULT_DB_URL, *, create: bool = True, echo: bool = False) -> Store:
    """Open (and by default create or upgrade) the result store at ``url``.

    create=True (writers): creates the parent folder of a SQLite file and upgrades the schema to
    the newest revision (``migrate``: locked, so concurrent writers are safe; a database from
    before migrations keeps its rows).
    create=False (readers: report, dashboard): never migrates; a missing SQLite file raises
    StoreNotFoundError and missing tables (an older schema) read as empty; nothing is written.

    Raises StoreURLError for an unparseable URL or a missing driver, StoreError when the
    server cannot be reached or the schema cannot be upgraded.
    """
    engine = _connect(url, create=create, echo=echo)
    try:
        if create:
            migrate(engine)
            has_tables = True
        else:
            with _errors_as_store_errors(engine):
                insp = inspect(engine)
                has_tables = insp.has_table("runs") and insp.has_table("results")
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, has_tables=has_tables)


# ------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cluster.results.store upgrade|current --db URL``. Exit 0; 1 on a database error;
    2 on a bad URL or bad arguments."""
    ap = argparse.ArgumentParser(
        prog="python -m cluster.results.store",
        description="Schema revision of the result store (Alembic, cluster/results/migrations).")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, text_ in (("upgrade", "upgrade the database to the newest revision (creating it if new); "
                                    "prints FROM -> TO"),
                        ("current", "print the database's revision (read-only)")):
        p = sub.add_parser(name, help=text_, description=text_)
        p.add_argument("--db", default=DEFAULT_DB_URL,
                       help=f"database URL (default {DEFAULT_DB_URL}; e.g. postgresql+psycopg://user@host/db)")
    args = ap.parse_args(argv)
    engine = None
    try:
        engine = _connect(args.db, create=args.command == "upgrade")
        head = head_revision()
        shown = safe_url(engine.url)
        if args.command == "upgrade":
            before, after = migrate(engine)
            note = " (already at head)" if before == after else ""
            print(f"{shown}: {before or 'none'} -> {after}{note}")
        else:
            with _errors_as_store_errors(engine):
                with engine.connect() as conn:
                    rev = _current_revision(conn)
                    tables = set(inspect(conn).get_table_names())
            if rev == head:
                print(f"{rev} (head)")
            elif rev is not None and not _known_revision(rev):
                print(f"{rev} (unknown to this code, whose head is {head}: upgraded by a newer version?)")
            elif rev is not None:
                print(f"{rev} (head is {head}: python -m cluster.results.store upgrade --db URL)")
            elif tables:
                print(f"none (tables from before migrations: upgrade stamps it {BASE_REVISION} and upgrades to "
                      f"{head})")
            else:
                print("none (empty database)")
    except StoreError as e:
        return cli_error(e)
    finally:
        if engine is not None:
            engine.dispose()
    return 0


if __name__ == "__main__":
    from cluster.results.store import main as _main  # the importable module, not a second copy as __main__

    sys.exit(_main())
