"""Fleet feedback: node reports (misses, guard failures, fallbacks, loads),
per-model policies (build on miss) and the jobs a miss started.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 17:35:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "node_reports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("ref", sa.String(length=64), nullable=True),
        sa.Column("version", sa.String(length=64), nullable=True),
        sa.Column("inputs", sa.Text(), nullable=False),
        sa.Column("grad_mode", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=True),
        sa.Column("digest", sa.String(length=64), nullable=True),
        sa.Column("code", sa.String(length=32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("node", sa.String(length=256), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_reports")),
    )
    op.create_index(op.f("ix_node_reports_received_at"), "node_reports", ["received_at"],
                    unique=False)
    op.create_index("ix_node_reports_model_kind_received", "node_reports",
                    ["model", "kind", "received_at"], unique=False)
    op.create_table(
        "model_policies",
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("build_on_miss", sa.Boolean(), nullable=False),
        sa.Column("min_interval_s", sa.Float(), nullable=False),
        sa.Column("last_build_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_by", sa.String(length=128), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model", name=op.f("pk_model_policies")),
    )
    op.create_table(
        "miss_builds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("inputs", sa.String(length=2048), nullable=False),
        sa.Column("grad_mode", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_miss_builds")),
        sa.UniqueConstraint("model", "version", "inputs", "grad_mode", "target",
                            name=op.f("uq_miss_builds_model_version_inputs_grad_mode_target")),
    )


def downgrade() -> None:
    op.drop_table("miss_builds")
    op.drop_table("model_policies")
    op.drop_index("ix_node_reports_model_kind_received", table_name="node_reports")
    op.drop_index(op.f("ix_node_reports_received_at"), table_name="node_reports")
    op.drop_table("node_reports")
