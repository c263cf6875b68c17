"""Engines, managed sessions and the schema's migrations.

Everything that talks SQL goes through a :class:`Database`: its ``session()``
commits on success, rolls back on any error and turns integrity errors into
:class:`Conflict` and an unreachable server into :class:`DatabaseUnavailable`,
so callers (the API, the workers) never handle driver exceptions.

The Alembic scripts ship inside the ``migrations`` package and the Alembic
configuration is built here, so ``farm db upgrade`` works from an installed
wheel with no ``alembic.ini`` in the working directory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Connection,
    Engine,
    PrimaryKeyConstraint,
    UniqueConstraint,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

import migrations
from farm.core.text import first_line as _first_line
from registry import models
from registry.convert import artifact_to_record

log = logging.getLogger(__name__)

__all__ = [
    "UPGRADE_COMMAND",
    "Conflict",
    "Database",
    "DatabaseError",
    "DatabaseUnavailable",
    "SchemaOutOfDate",
    "alembic_config",
    "artifact_to_record",
    "check_schema",
    "current_revision",
    "downgrade",
    "head_revision",
    "make_engine",
    "migration_engine",
    "run_migrations",
    "upgrade",
]

UPGRADE_COMMAND = "farm db upgrade"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Any constant works: it only has to be the same for every process that migrates.
_MIGRATION_LOCK_ID = 0x7F_A2_3D_01
MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


class DatabaseError(Exception):
    """Base of the errors this module raises instead of driver exceptions."""


class Conflict(DatabaseError):
    """A write broke a uniqueness or integrity rule: the row (or its parent) says no.

    ``constraint`` is the violated constraint's name where the backend tells
    it (named by ``models.NAMING``, so the same on PostgreSQL and SQLite).
    """

    def __init__(self, message: str, *, constraint: str | None = None) -> None:
        super().__init__(message)
        self.constraint = constraint

    @classmethod
    def from_integrity_error(cls, exc: IntegrityError) -> Conflict:
        constraint, detail = _describe_integrity_error(exc)
        where = f" ({constraint})" if constraint else ""
        return cls(f"conflicts with existing data{where}: {detail}", constraint=constraint)


class DatabaseUnavailable(DatabaseError):
    """The database server cannot be reached; the API answers 503 for it."""


class SchemaOutOfDate(DatabaseError):
    """The database's schema is not the one this code was written for."""


def _normalize_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(
            f"bad database URL {url!r}: expected postgresql+psycopg://USER@HOST:PORT/DB "
            "or sqlite:///PATH"
        ) from None
    # Only psycopg (v3) is a dependency; a bare scheme would make SQLAlchemy
    # look for psycopg2.
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _redacted(url: str | URL) -> str:
    try:
        return _normalize_url(url).render_as_string(hide_password=True)
    except ValueError:
        return "<unparseable URL>"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets the API read while a worker commits; readers never block.
        cursor.execute("PRAGMA journal_mode=WAL")
        # SQLite ignores FOREIGN KEY clauses (and ON DELETE CASCADE) unless asked.
        cursor.execute("PRAGMA foreign_keys=ON")
        # Embedded mode has the API and workers writing one file: wait for the
        # lock rather than fail at once with "database is locked".
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _sqlite_savepoint_in_transaction(connection: Connection, _name: str | None) -> None:
    # pysqlite opens a transaction only before INSERT/UPDATE/DELETE. A
    # SAVEPOINT sent outside one opens its own, and releasing it then COMMITs:
    # a begin_nested() as a session's first write would escape the session's
    # rollback. Open the real transaction first.
    driver_connection = connection.connection.driver_connection
    if driver_connection is not None and not driver_connection.in_transaction:
        driver_connection.execute("BEGIN")


def make_engine(url: str | URL, *, echo: bool = False) -> Engine:
    """An engine for PostgreSQL (psycopg 3) or SQLite, configured for this farm."""
    sa_url = _normalize_url(url)
    backend = sa_url.get_backend_name()
    if backend == "sqlite":
        database = sa_url.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(sa_url, echo=echo)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "savepoint", _sqlite_savepoint_in_transaction)
        return engine
    if backend == "postgresql":
        # pre_ping: a pooled connection may have been cut by a server restart
        # or a proxy's idle timeout; test it instead of failing a request.
        return create_engine(
            sa_url,
            echo=echo,
            pool_pre_ping=True,
            # A black-holed database host must give a quick 503, not an OS TCP
            # timeout; and a connection whose host went silent mid-query (a
            # cable pulled: no FIN, no reset) must fail in seconds rather than
            # sit in TCP's retransmit backoff for minutes, long after the link
            # is back (a worker's heartbeat thread would sit there with it).
            # tcp_user_timeout bounds unacknowledged sends, keepalives a wait
            # for a reply from a host that is gone; neither ends a long query
            # of a live server, whose kernel acknowledges both.
            connect_args={"connect_timeout": 5, "tcp_user_timeout": 10_000,
                          "keepalives": 1, "keepalives_idle": 10,
                          "keepalives_interval": 3, "keepalives_count": 3},
        )
    raise ValueError(
        f"unsupported database URL {_redacted(sa_url)!r}; "
        "known schemes: postgresql+psycopg://, postgresql://, sqlite:///"
    )


class Database:
    """An engine and the sessions made from it.

    ``check=True`` refuses, at construction, a database whose schema is not
    at this code's head revision (``SchemaOutOfDate``).
    """

    def __init__(self, url: str | URL, *, check: bool = False, echo: bool = False) -> None:
        self.url = _normalize_url(url)
        self.engine = make_engine(self.url, echo=echo)
        # Rows stay readable after commit: converting them to entities right
        # after the commit must not trigger a reload.
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)
        if check:
            try:
                check_schema(self.engine)
            except BaseException:
                self.engine.dispose()
                raise

    def __repr__(self) -> str:
        return f"Database({_redacted(self.url)!r})"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work: committed when the block ends, rolled back on any error.

        Raises ``Conflict`` for integrity errors (at flush or commit) and
        ``DatabaseUnavailable`` when the server cannot be reached.
        """
        session = self.sessionmaker()
        try:
            try:
                # Connect now, so an unreachable server is reported as such
                # before the caller's code runs, not as some later query error.
                session.connection()
            except DBAPIError as exc:
                raise DatabaseUnavailable(
                    f"cannot reach the database at {_redacted(self.url)}: {_first_line(exc.orig)}"
                ) from exc
            yield session
            session.commit()
        except IntegrityError as exc:
            _rollback_quietly(session)
            raise Conflict.from_integrity_error(exc) from exc
        except OperationalError as exc:
            _rollback_quietly(session)
            if exc.connection_invalidated:
                raise DatabaseUnavailable(
                    f"lost the connection to {_redacted(self.url)}: {_first_line(exc.orig)}"
                ) from exc
            raise
        except BaseException:
            _rollback_quietly(session)
            raise
        finally:
            session.close()

    def check_schema(self) -> None:
        check_schema(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()


def _rollback_quietly(session: Session) -> None:
    # A rollback that fails (the connection is gone) must not hide the error
    # that caused it.
    try:
        session.rollback()
    except Exception:
        log.warning("rollback failed", exc_info=True)


_SQLITE_UNIQUE = re.compile(r"^UNIQUE constraint failed: (.+)$")


def _describe_integrity_error(exc: IntegrityError) -> tuple[str | None, str]:
    orig = exc.orig
    diag = getattr(orig, "diag", None)
    if diag is not None:  # psycopg: the server names the constraint
        detail = diag.message_detail or diag.message_primary or _first_line(orig)
        return diag.constraint_name, detail
    message = _first_line(orig)
    match = _SQLITE_UNIQUE.match(message)
    if match:
        return _sqlite_unique_name(match.group(1)), message
    return None, message


def _sqlite_unique_name(columns_text: str) -> str | None:
    """The name of the unique constraint SQLite reports only by its columns."""
    qualified = [c.strip() for c in columns_text.split(",")]
    tables = {c.partition(".")[0] for c in qualified}
    if len(tables) != 1:
        return None
    table = models.Base.metadata.tables.get(tables.pop())
    if table is None:
        return None
    columns = [c.partition(".")[2] for c in qualified]
    for constraint in table.constraints:
        if (
            isinstance(constraint, (UniqueConstraint, PrimaryKeyConstraint))
            and [c.name for c in constraint.columns] == columns
            and isinstance(constraint.name, str)
        ):
            return constraint.name
    return None


# --- migrations -------------------------------------------------------------


def alembic_config(url: str | URL | None = None) -> Config:
    """Alembic's configuration, built in code so that it works from an installed
    package; ``url`` (when given) is what env.py migrates."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        # ConfigParser interpolation would eat a '%' in a password.
        rendered = _normalize_url(url).render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


def _script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision shipped with this code."""
    head = _script_directory().get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def migration_engine(url: str | URL) -> Engine:
    """An engine fit for running migrations (used by ``migrations/env.py``).

    On SQLite it hands transaction control to SQLAlchemy, because pysqlite
    only opens transactions before DML: DDL would otherwise commit statement
    by statement and a failed migration would leave half a schema behind.
    """
    engine = make_engine(url)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _manual_transactions(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            # Batch migrations copy and drop tables; with foreign keys on, the
            # drop would cascade into the rows that reference them.
            dbapi_connection.execute("PRAGMA foreign_keys=OFF")

        @event.listens_for(engine, "begin")
        def _begin(connection: Connection) -> None:
            # IMMEDIATE takes the write lock up front (waiting busy_timeout for
            # it): a second process migrating at the same time waits, then
            # finds the work done, as the advisory lock does on PostgreSQL.
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def run_migrations(url: str | URL, action: str, revision: str) -> None:
    """Run alembic ``upgrade``/``downgrade`` in one transaction, one process at a time."""
    if action not in ("upgrade", "downgrade"):
        raise ValueError(f"unknown migration action {action!r}; known: upgrade, downgrade")
    cfg = alembic_config(url)
    engine = migration_engine(url)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                # Several services may start (and migrate) at once; the
                # second waits and then finds nothing to do.
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID}
                )
            cfg.attributes["connection"] = connection
            getattr(command, action)(cfg, revision)
            if connection.dialect.name == "sqlite":
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(
                        f"migration to {revision} left rows with dangling foreign keys: "
                        f"{broken[:5]}"
                    )
    except OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot migrate {_redacted(url)}: {_first_line(exc.orig)}"
        ) from exc
    finally:
        engine.dispose()
    log.info("database %s: %s to %s done", _redacted(url), action, revision)


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Upgrade the schema at ``url`` to ``revision`` (default: this code's head)."""
    run_migrations(url, "upgrade", revision)


def downgrade(url: str | URL, revision: str = "base") -> None:
    """Downgrade the schema at ``url`` to ``revision`` (default: nothing at all)."""
    run_migrations(url, "downgrade", revision)


def _current_heads(engine: Engine) -> tuple[str, ...]:
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_heads()
    except OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot reach the database at {_redacted(engine.url)}: {_first_line(exc.orig)}"
        ) from exc


def current_revision(url: str | URL) -> str | None:
    """The revision the database at ``url`` is at; None for an empty database."""
    engine = make_engine(url)
    try:
        heads = _current_heads(engine)
    finally:
        engine.dispose()
    return heads[0] if len(heads) == 1 else (",".join(heads) or None)


def check_schema(engine: Engine) -> None:
    """Raise ``SchemaOutOfDate`` unless the database is at this code's head revision."""
    head = head_revision()
    heads = _current_heads(engine)
    if heads == (head,):
        return
    where = _redacted(engine.url)
    if not heads:
        raise SchemaOutOfDate(
            f"the database at {where} has no torch-farm schema (empty or never migrated); "
            f"run `{UPGRADE_COMMAND}` to create it"
        )
    known = {rev.revision for rev in _script_directory().walk_revisions()}
    unknown = [h for h in heads if h not in known]
    if unknown:
        raise SchemaOutOfDate(
            f"the database at {where} is at revision {', '.join(unknown)}, which this "
            f"torch-farm does not know (its newest is {head}): a newer torch-farm migrated "
            "it; install that version, or downgrade the database with it"
        )
    raise SchemaOutOfDate(
        f"the database at {where} is at revision {', '.join(heads)} but this torch-farm "
        f"needs {head}; run `{UPGRADE_COMMAND}`"
    )
