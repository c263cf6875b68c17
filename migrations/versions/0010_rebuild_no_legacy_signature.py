"""A job may ask for a fresh build (``farm submit --rebuild``); the artifact
rows' legacy ``signature`` column goes: nodes trust the signed build
statement (``attestation``) alone, and no code wrote the column any more.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 18:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("rebuild", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("signature")


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("signature", sa.Text(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("rebuild")
