"""Attestations: enrolled signing keys, root-signed trust lists, name bindings,
and the build statement stored with each artifact.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 14:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "signing_keys",
        sa.Column("keyid", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("enrolled_by", sa.String(length=128), nullable=True),
        sa.Column("enrolled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("keyid", name=op.f("pk_signing_keys")),
    )
    op.create_table(
        "trust_lists",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("envelope", sa.Text(), nullable=False),
        sa.Column("root_keyid", sa.String(length=64), nullable=False),
        sa.Column("uploaded_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_trust_lists")),
    )
    op.create_table(
        "name_bindings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("ref", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("envelope", sa.Text(), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_name_bindings")),
        sa.UniqueConstraint("model", "kind", "ref", name=op.f("uq_name_bindings_model_kind_ref")),
    )
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("attestation", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("attestation")
    op.drop_table("name_bindings")
    op.drop_table("trust_lists")
    op.drop_table("signing_keys")
