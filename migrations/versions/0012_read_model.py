"""What the API's in-process read model of resolve needs from the database.

- ``version_artifacts.artifact_id`` indexed (the trigger below looks it up).
- ``artifacts.attestation_sha256``: the sha256 of the stored build statement,
  so a resolve answer names it by digest (``/v1/attestations/<digest>``)
  without reading it, and that route finds it by an index (backfilled here).
- ``read_model_generation``: one row counting the transactions that changed
  what a resolve reads (models, versions, aliases, name statements, the
  version-to-artifact links, artifacts). Every API process polls it as the
  fallback while its PostgreSQL notification channel is down; SQLite (the
  embedded farm) compares it before each resolve.
- PostgreSQL triggers: each changed row also sends ``NOTIFY farm_read_model``
  with its model's name, delivered at commit, so every API process drops
  that model from its read model before its next resolve. Triggers rather
  than calls in the service layer: every writer (API, workers, ``farm db``,
  an operator's psql) is covered.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 18:40:00
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The tables whose changes a resolve sees (registry.service.read_model_load reads them).
WATCHED = ("models", "model_versions", "aliases", "name_bindings", "version_artifacts", "artifacts")
CHANNEL = "farm_read_model"

_PG_BUMP = """
CREATE FUNCTION farm_read_model_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE read_model_generation SET n = n + 1 WHERE id = 1;
    RETURN NULL;
END $$;
"""

# One notification per changed row, naming its model (PostgreSQL folds equal
# payloads of one transaction into one). A row whose parent is already gone
# (a cascade) names nothing: the parent's own row notifies.
_PG_NOTIFY = f"""
CREATE FUNCTION farm_read_model_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r RECORD;
    model_name TEXT;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    IF TG_TABLE_NAME = 'models' THEN
        model_name := r.name;
        IF TG_OP = 'UPDATE' AND OLD.name IS DISTINCT FROM NEW.name THEN
            PERFORM pg_notify('{CHANNEL}', OLD.name);
        END IF;
    ELSIF TG_TABLE_NAME = 'name_bindings' THEN
        model_name := r.model;
    ELSIF TG_TABLE_NAME IN ('model_versions', 'aliases') THEN
        SELECT m.name INTO model_name FROM models m WHERE m.id = r.model_id;
    ELSIF TG_TABLE_NAME = 'version_artifacts' THEN
        SELECT m.name INTO model_name FROM model_versions v JOIN models m ON m.id = v.model_id
            WHERE v.id = r.version_id;
    ELSIF TG_TABLE_NAME = 'artifacts' THEN
        PERFORM pg_notify('{CHANNEL}', m.name) FROM version_artifacts va
            JOIN model_versions v ON v.id = va.version_id JOIN models m ON m.id = v.model_id
            WHERE va.artifact_id = r.id;
    END IF;
    IF model_name IS NOT NULL THEN
        PERFORM pg_notify('{CHANNEL}', model_name);
    END IF;
    RETURN NULL;
END $$;
"""


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("attestation_sha256", sa.String(length=64), nullable=True))
        batch.create_index("ix_artifacts_attestation_sha256", ["attestation_sha256"])
    # The artifacts' trigger finds an artifact's versions by it (and a
    # cascade from a deleted artifact no longer scans the table).
    op.create_index("ix_version_artifacts_artifact_id", "version_artifacts", ["artifact_id"])
    op.create_table(
        "read_model_generation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_read_model_generation")),
    )
    bind = op.get_bind()
    bind.execute(sa.text("INSERT INTO read_model_generation (id, n) VALUES (1, 0)"))
    _backfill(bind)
    if bind.dialect.name == "postgresql":
        bind.execute(sa.text(_PG_BUMP))
        bind.execute(sa.text(_PG_NOTIFY))
        for table in WATCHED:
            bind.execute(
                sa.text(
                    f"CREATE TRIGGER read_model_bump AFTER INSERT OR UPDATE OR DELETE ON {table} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION farm_read_model_bump()"
                )
            )
            # A new artifact is in no version until its link row is written
            # (which notifies): its own insert names nothing.
            events = "UPDATE OR DELETE" if table == "artifacts" else "INSERT OR UPDATE OR DELETE"
            bind.execute(
                sa.text(
                    f"CREATE TRIGGER read_model_notify AFTER {events} ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION farm_read_model_notify()"
                )
            )
    else:  # SQLite: row triggers only; the embedded farm compares the count per resolve
        for table in WATCHED:
            for event in ("INSERT", "UPDATE", "DELETE"):
                bind.execute(
                    sa.text(
                        f"CREATE TRIGGER read_model_{table}_{event.lower()} "
                        f"AFTER {event} ON {table} "
                        "BEGIN UPDATE read_model_generation SET n = n + 1 WHERE id = 1; END"
                    )
                )


def _backfill(bind: sa.Connection) -> None:
    rows = bind.execute(
        sa.text("SELECT id, attestation FROM artifacts WHERE attestation IS NOT NULL")
    ).all()
    for art_id, text in rows:
        bind.execute(
            sa.text("UPDATE artifacts SET attestation_sha256 = :d WHERE id = :i"),
            {"d": hashlib.sha256(text.encode()).hexdigest(), "i": art_id},
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        for table in WATCHED:
            bind.execute(sa.text(f"DROP TRIGGER IF EXISTS read_model_bump ON {table}"))
            bind.execute(sa.text(f"DROP TRIGGER IF EXISTS read_model_notify ON {table}"))
        bind.execute(sa.text("DROP FUNCTION IF EXISTS farm_read_model_notify()"))
        bind.execute(sa.text("DROP FUNCTION IF EXISTS farm_read_model_bump()"))
    else:
        for table in WATCHED:
            for event in ("insert", "update", "delete"):
                bind.execute(sa.text(f"DROP TRIGGER IF EXISTS read_model_{table}_{event}"))
    op.drop_table("read_model_generation")
    op.drop_index("ix_version_artifacts_artifact_id", table_name="version_artifacts")
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_index("ix_artifacts_attestation_sha256")
        batch.drop_column("attestation_sha256")
