"""Alembic environment.

Run two ways: by ``registry.db.upgrade``/``downgrade``, which hand over an open
connection (in ``config.attributes["connection"]``) inside their own
transaction, or by the alembic command line with ``migrations/alembic.ini``,
which names the database with ``-x url=...``, ``sqlalchemy.url`` or, failing
both, the farm's own ``DATABASE_URL`` setting.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from alembic import context
from sqlalchemy import Connection

from registry import models
from registry.db import migration_engine

config = context.config
target_metadata = models.Base.metadata


def _database_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if url:
        return url
    from farm.core.settings import get_settings

    return get_settings().resolved_database_url()


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # Migrations must not import the models (they change; a migration does
    # not), so the models' UTC wrapper is written as the column type it stores.
    if type_ == "type" and isinstance(obj, models.UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table instead,
        # and on PostgreSQL the same scripts run as plain ALTERs.
        render_as_batch=True,
        compare_type=True,
        render_item=_render_item,
        **kwargs,
    )


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    _configure(url=_database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    if config.config_file_name and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = migration_engine(_database_url())
    try:
        with engine.begin() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
