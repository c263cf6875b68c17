"""The trace's count of repeated-block calls as a column of ``jobs``.

The job view says where a per-block build would help from the number of
repeated blocks (transformer layers) the trace found. It read that from the
trace report kept in ``jobs.log``, which is clipped for long reports and
replaced by the error when a later stage fails; a column keeps it whatever
happens to the log. Backfilled from the logs that still hold a report.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 03:40:00
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("repeated_blocks", sa.Integer(), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, log FROM jobs WHERE fingerprint IS NOT NULL")).all()
    counts = [{"n": n, "id": job_id} for job_id, log in rows if (n := _regions(log)) is not None]
    if counts:  # one executemany, not a statement per job
        bind.execute(sa.text("UPDATE jobs SET repeated_blocks = :n WHERE id = :id"), counts)


def _regions(log: str | None) -> int | None:
    try:
        report = json.loads(log or "")
    except ValueError:
        return None
    if not isinstance(report, dict):
        return None
    try:
        return int(report.get("regions") or 0)
    except (TypeError, ValueError):
        return None


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("repeated_blocks")
