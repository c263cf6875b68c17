"""Compiler identity: the C++ compiler an artifact was built with, and the
libstdc++ symbol versions (GLIBCXX_*, CXXABI_*) its shared library needs,
which the resolver holds against what a node's libstdc++ provides.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 15:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("cxx", sa.String(length=256), nullable=True))
        # NULL for rows from before this revision: nothing recorded to check.
        batch.add_column(sa.Column("libstdcxx_needs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("libstdcxx_needs")
        batch.drop_column("cxx")
