"""acceptance_steps: one row per verify step of a stored result (the per-step acceptance trace)

``step`` is the 0-based verify step of the request, ``k`` the draft tokens proposed and counted
in it (0 = that step drafted nothing), ``accepted`` how many of them the target accepted.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "acceptance_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("result_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("result_id", "step", name="uq_acceptance_steps_result_step"),
        sa.ForeignKeyConstraint(["result_id"], ["results.id"], ondelete="CASCADE"),
    )
    op.create_index("ix_acceptance_steps_result_id", "acceptance_steps", ["result_id"])


def downgrade() -> None:
    op.drop_table("acceptance_steps")
