"""Shared compile caches: one salt per target (``farm cache salt TARGET``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 17:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "cache_salts",
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("salt", sa.String(length=64), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("target", name=op.f("pk_cache_salts")),
    )


def downgrade() -> None:
    op.drop_table("cache_salts")
