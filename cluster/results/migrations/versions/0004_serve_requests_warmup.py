"""serve_requests.warmup: a client's warm-up request, stored but left out of the A/B views

``cluster.serve.loadtest`` sends its warm-up requests with the ``x-sparsespec-warmup`` header
(``cluster.results.ab.WARMUP_HEADER``); the endpoint stores the flag, and
``Store.serve_requests`` leaves those rows out unless asked, so the dashboard's A/B decision
counts the same requests as the load test's. Rows stored before this revision are not warm-ups
(false): their warm-ups cannot be told apart afterwards.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("serve_requests", sa.Column("warmup", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("serve_requests") as batch:  # SQLite: DROP COLUMN by copying the table
        batch.drop_column("warmup")
