"""Alias history and the running build's stage.

``alias_events`` keeps every move of an alias (what rollbacks read);
``builds.stage`` and ``builds.stage_at`` say what a running build is doing.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 14:20:00
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
        "alias_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=True),
        sa.Column("previous", sa.String(length=64), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alias_events")),
    )
    op.create_index("ix_alias_events_model_alias", "alias_events", ["model", "alias"],
                    unique=False)
    with op.batch_alter_table("builds") as batch:
        batch.add_column(sa.Column("stage", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("stage_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("builds") as batch:
        batch.drop_column("stage_at")
        batch.drop_column("stage")
    op.drop_index("ix_alias_events_model_alias", table_name="alias_events")
    op.drop_table("alias_events")
