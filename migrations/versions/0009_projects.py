"""Projects own models; tokens hold roles per project.

Carries what exists into a ``default`` project: every model, and a role there
for every live token that could write before (submit -> maintainer, admin ->
owner). Read tokens get none: a token with no project role reads every
project, as fleet nodes' read tokens did. An alias named like a version of its
model (the version always won, so the alias was dead, and a version named like
an alias could take it over) is renamed ``<name>-alias``, and the rename is
written into the alias history.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT = "default"
ACTOR = "migration 0009"
_ROLE_OF = {"submit": "maintainer", "admin": "owner"}


def upgrade() -> None:
    now = datetime.now(timezone.utc)
    op.create_table(
        "projects",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_projects")),
    )
    op.create_table(
        "project_roles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("principal", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("granted_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["project"],
            ["projects.name"],
            ondelete="CASCADE",
            name=op.f("fk_project_roles_project_projects"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project_roles")),
        sa.UniqueConstraint(
            "project", "principal", name=op.f("uq_project_roles_project_principal")
        ),
    )
    op.create_index(op.f("ix_project_roles_principal"), "project_roles", ["principal"])
    conn = op.get_bind()
    conn.execute(
        sa.text("INSERT INTO projects (name, created_by, created_at) VALUES (:n, :by, :at)"),
        {"n": DEFAULT, "by": ACTOR, "at": now},
    )

    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("project", sa.String(length=64), nullable=True))
    conn.execute(sa.text("UPDATE models SET project = :n"), {"n": DEFAULT})
    with op.batch_alter_table("models") as batch:
        batch.alter_column("project", existing_type=sa.String(length=64), nullable=False)
        batch.create_foreign_key(
            op.f("fk_models_project_projects"), "projects", ["project"], ["name"]
        )
        batch.create_index(op.f("ix_models_project"), ["project"])
    with op.batch_alter_table("alias_events") as batch:
        batch.add_column(sa.Column("project", sa.String(length=64), nullable=True))

    # Roles: one per token name (revocation is by name too), the highest its
    # live tokens had.
    best: dict[str, str] = {}
    for name, role in conn.execute(
        sa.text("SELECT name, role FROM api_tokens WHERE revoked = :f"), {"f": False}
    ):
        mapped = _ROLE_OF.get(role)
        if mapped is not None and best.get(name) != "owner":
            best[name] = mapped
    for name, role in sorted(best.items()):
        conn.execute(
            sa.text(
                "INSERT INTO project_roles (project, principal, role, granted_by, created_at) "
                "VALUES (:p, :who, :role, :by, :at)"
            ),
            {"p": DEFAULT, "who": name, "role": role, "by": ACTOR, "at": now},
        )

    _rename_shadowed_aliases(conn, now)


def _rename_shadowed_aliases(conn: sa.Connection, now: datetime) -> None:
    rows = conn.execute(
        sa.text(
            "SELECT a.id, a.name, m.name, v.version FROM aliases a "
            "JOIN models m ON m.id = a.model_id "
            "JOIN model_versions v ON v.id = a.version_id "
            "WHERE EXISTS (SELECT 1 FROM model_versions o "
            "              WHERE o.model_id = a.model_id AND o.version = a.name)"
        )
    ).all()
    for alias_id, alias, model, version in rows:
        taken = {
            r[0]
            for r in conn.execute(
                sa.text(
                    "SELECT a.name FROM aliases a JOIN models m ON m.id = a.model_id "
                    "WHERE m.name = :m UNION SELECT v.version FROM model_versions v "
                    "JOIN models m ON m.id = v.model_id WHERE m.name = :m"
                ),
                {"m": model},
            )
        }
        new, n = f"{alias}-alias", 2
        while new in taken:
            new, n = f"{alias}-alias{n}", n + 1
        conn.execute(
            sa.text("UPDATE aliases SET name = :new WHERE id = :id"), {"new": new, "id": alias_id}
        )
        # The old alias's signed statement names the old alias: the new one
        # has none until a maintainer sets it again (nodes refuse it before).
        conn.execute(
            sa.text("DELETE FROM name_bindings WHERE model = :m AND kind = 'alias' AND ref = :a"),
            {"m": model, "a": alias},
        )
        for name, to, prev, why in (
            (alias, None, version, f"{ACTOR}: shadowed by version {alias!r}, renamed {new!r}"),
            (new, version, None, f"{ACTOR}: renamed from {alias!r}"),
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO alias_events (model, alias, version, previous, actor, project, "
                    "created_at) VALUES (:m, :a, :v, :p, :who, :proj, :at)"
                ),
                {
                    "m": model,
                    "a": name,
                    "v": to,
                    "p": prev,
                    "who": why[:128],
                    "proj": DEFAULT,
                    "at": now,
                },
            )


def downgrade() -> None:
    with op.batch_alter_table("alias_events") as batch:
        batch.drop_column("project")
    with op.batch_alter_table("models") as batch:
        batch.drop_index(op.f("ix_models_project"))
        batch.drop_constraint(op.f("fk_models_project_projects"), type_="foreignkey")
        batch.drop_column("project")
    op.drop_index(op.f("ix_project_roles_principal"), table_name="project_roles")
    op.drop_table("project_roles")
    op.drop_table("projects")
