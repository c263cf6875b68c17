"""Initial schema.

Models, versions, aliases, jobs, builds, artifacts, compile claims, API tokens,
worker heartbeats and resolve misses, as registry/models.py declares them.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 20:32:32.919878
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("build_key", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("inputs", sa.Text(), nullable=False),
        sa.Column("grad_mode", sa.String(length=16), nullable=False),
        sa.Column("options", sa.Text(), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("device", sa.String(length=16), nullable=False),
        sa.Column("gpu_name", sa.String(length=128), nullable=True),
        sa.Column("capability", sa.String(length=16), nullable=True),
        sa.Column("torch_version", sa.String(length=64), nullable=False),
        sa.Column("triton_version", sa.String(length=16), nullable=True),
        sa.Column("python_version", sa.String(length=16), nullable=False),
        sa.Column("cuda_version", sa.String(length=16), nullable=True),
        sa.Column("cpu_isa", sa.String(length=32), nullable=True),
        sa.Column("threads", sa.Integer(), nullable=True),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("first_call_compiles", sa.Boolean(), nullable=False),
        sa.Column("max_abs_err", sa.Float(), nullable=True),
        sa.Column("first_call_s", sa.Float(), nullable=True),
        sa.Column("load_s", sa.Float(), nullable=True),
        sa.Column("signature", sa.Text(), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint("build_key", "format", name=op.f("uq_artifacts_build_key_format")),
    )
    op.create_index(op.f("ix_artifacts_digest"), "artifacts", ["digest"], unique=False)
    op.create_index(
        "ix_artifacts_lookup", "artifacts", ["fingerprint", "device", "torch_version"], unique=False
    )

    op.create_table(
        "compile_claims",
        sa.Column("build_key", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("worker", sa.String(length=256), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("build_key", name=op.f("pk_compile_claims")),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("name", name=op.f("uq_models_name")),
    )
    op.create_table(
        "resolve_misses",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=True),
        sa.Column("inputs", sa.Text(), nullable=False),
        sa.Column("grad_mode", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("reasons", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_resolve_misses")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=True),
        sa.Column("queue", sa.String(length=600), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_last_seen"), "workers", ["last_seen"], unique=False)

    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("entrypoint", sa.String(length=512), nullable=False),
        sa.Column("kwargs", sa.JSON(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_model_versions_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("model_id", "version", name=op.f("uq_model_versions_model_id_version")),
    )
    op.create_table(
        "aliases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_aliases_model_id_models"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["model_versions.id"],
            name=op.f("fk_aliases_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_aliases")),
        sa.UniqueConstraint("model_id", "name", name=op.f("uq_aliases_model_id_name")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("inputs", sa.Text(), nullable=False),
        sa.Column("grad_mode", sa.String(length=16), nullable=False),
        sa.Column("options", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.Column("param_count", sa.BigInteger(), nullable=True),
        sa.Column("param_bytes", sa.BigInteger(), nullable=True),
        sa.Column("flops", sa.BigInteger(), nullable=True),
        sa.Column("trace_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("log", sa.Text(), nullable=True),
        sa.Column("submitted_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["model_versions.id"],
            name=op.f("fk_jobs_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_state"), "jobs", ["state"], unique=False)

    op.create_table(
        "version_artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"],
            ["artifacts.id"],
            name=op.f("fk_version_artifacts_artifact_id_artifacts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["model_versions.id"],
            name=op.f("fk_version_artifacts_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_version_artifacts")),
        sa.UniqueConstraint(
            "version_id", "artifact_id", name=op.f("uq_version_artifacts_version_id_artifact_id")
        ),
    )
    op.create_table(
        "builds",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("build_key", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=256), nullable=True),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("compile_s", sa.Float(), nullable=True),
        sa.Column("artifact_bytes", sa.BigInteger(), nullable=True),
        sa.Column("verified", sa.Boolean(), nullable=True),
        sa.Column("max_abs_err", sa.Float(), nullable=True),
        sa.Column("first_call_s", sa.Float(), nullable=True),
        sa.Column("first_call_compiles", sa.Boolean(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("log", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_builds_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_builds")),
        sa.UniqueConstraint("job_id", "target", name=op.f("uq_builds_job_id_target")),
    )
    op.create_index(op.f("ix_builds_build_key"), "builds", ["build_key"], unique=False)
    op.create_index(op.f("ix_builds_state"), "builds", ["state"], unique=False)


def downgrade() -> None:
    op.drop_table("builds")
    op.drop_table("version_artifacts")
    op.drop_table("jobs")
    op.drop_table("aliases")
    op.drop_table("model_versions")
    op.drop_table("workers")
    op.drop_table("resolve_misses")
    op.drop_table("models")
    op.drop_table("compile_claims")
    op.drop_table("artifacts")
    op.drop_table("api_tokens")
