"""The worker tracing a job, so the sweep re-sends a trace as soon as that
worker's heartbeat stops instead of after the trace time limit.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 05:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("trace_worker", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("trace_worker")
