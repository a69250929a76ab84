"""initial schema: runs, results, shards, bench, serve_requests

The schema the store had before migrations (written by ``Base.metadata.create_all``). A database
made by that code has these tables and no ``alembic_version``; ``cluster.results.store.migrate`` stamps it
with this revision (creating any of these tables it lacks, through ``TABLES``) and upgrades on.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# JSON on SQLite, JSONB on PostgreSQL (frozen here: a later change of cluster.results.store.JSONType is a
# new revision)
JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _tz() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def create_runs() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("benchmark", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("methods", JSONType, nullable=False),
        sa.Column("config", JSONType, nullable=False),
        sa.Column("created_at", _tz(), nullable=False),
        sa.Column("finished_at", _tz(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("host", JSONType, nullable=True),
        sa.Column("events", JSONType, nullable=True),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_index("ix_runs_benchmark", "runs", ["benchmark"])


def create_results() -> None:
    op.create_table(
        "results",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("benchmark", sa.String(64), nullable=False),
        sa.Column("task", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("method", sa.String(64), nullable=False),
        sa.Column("sample_id", sa.String(256), nullable=False),
        sa.Column("prediction", sa.Text(), nullable=False),
        sa.Column("token_ids", JSONType, nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("stats", JSONType, nullable=False),
        sa.Column("lossless", sa.Boolean(), nullable=True),
        sa.Column("first_divergence", sa.Integer(), nullable=True),
        sa.Column("num_input_tokens_raw", sa.Integer(), nullable=False),
        sa.Column("num_input_tokens", sa.Integer(), nullable=False),
        sa.Column("references", JSONType, nullable=False),  # an SQL keyword: quoted on every dialect
        sa.Column("created_at", _tz(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "task", "sample_id", "method", name="uq_results_run_task_sample_method"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    op.create_index("ix_results_run_id", "results", ["run_id"])


def create_shards() -> None:
    op.create_table(
        "shards",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("task", sa.String(128), nullable=False),
        sa.Column("sample_ids", JSONType, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker", JSONType, nullable=True),
        sa.Column("wall_s", sa.Float(), nullable=True),
        sa.Column("started_at", _tz(), nullable=True),
        sa.Column("finished_at", _tz(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "key", name="uq_shards_run_key"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    op.create_index("ix_shards_run_id", "shards", ["run_id"])


def create_bench() -> None:
    op.create_table(
        "bench",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("context_len", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(64), nullable=False),
        sa.Column("metrics", JSONType, nullable=False),
        sa.Column("created_at", _tz(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        # unnamed, as create_all made it (PostgreSQL names it bench_run_id_kind_..._key)
        sa.UniqueConstraint("run_id", "kind", "context_len", "batch_size", "method"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
    )
    op.create_index("ix_bench_run_id", "bench", ["run_id"])


def create_serve_requests() -> None:
    op.create_table(
        "serve_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("experiment", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("arm", sa.String(128), nullable=True),
        sa.Column("method", sa.String(64), nullable=True),
        sa.Column("session", sa.String(256), nullable=True),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("queue_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("e2el_s", sa.Float(), nullable=True),
        sa.Column("stats", JSONType, nullable=True),
        sa.Column("created_at", _tz(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("request_id"),  # unnamed (PostgreSQL: serve_requests_request_id_key)
    )
    op.create_index("ix_serve_requests_experiment", "serve_requests", ["experiment"])
    op.create_index("ix_serve_requests_arm", "serve_requests", ["arm"])
    op.create_index("ix_serve_requests_created_at", "serve_requests", ["created_at"])


#: This revision's tables in creation order (foreign keys point backwards), each with its creator
#: (``cluster.results.store.migrate`` creates those a pre-migration database lacks before stamping it).
TABLES: dict[str, Callable[[], None]] = {
    "runs": create_runs,
    "results": create_results,
    "shards": create_shards,
    "bench": create_bench,
    "serve_requests": create_serve_requests,
}


def upgrade() -> None:
    for create in TABLES.values():
        create()


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)  # its indexes go with it
