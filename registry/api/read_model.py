"""The API process's read model of resolve: every model's candidates in memory,
kept current from the database's change notifications.

Artifacts and statements are immutable and content-addressed, so this is
replication, not a cache that may be stale: a change (a new artifact, an
alias moved, a version added or deleted) reaches the read model through the
database itself. PostgreSQL's triggers (migration 0010) send ``NOTIFY
farm_read_model`` with the changed model's name at commit; a thread here
listens and drops that model, and the next resolve of it reads it again (one
load per model, whoever asks). While that channel is down (the connection
cut, the database restarting) the thread polls ``read_model_generation``
every ``poll_s`` instead and drops everything when it moves, and on
reconnecting it drops everything if the generation moved meanwhile (what
was sent while it was away is lost).
SQLite (the embedded farm) has no notifications: each resolve compares the
generation, a read of one row of a local file.

A load that began before a drop is not stored (``_epoch``): it may have read
the rows from before the change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from select import POLLERR, POLLHUP, POLLIN, poll
from typing import Any

from sqlalchemy import select

from registry import models as m
from registry.db import Database
from registry.service import NotFound
from registry.service.read_model_load import ModelView, load_all, load_models

log = logging.getLogger(__name__)

CHANNEL = "farm_read_model"
# Names asked for that do not exist, remembered so a fleet asking for a
# missing model is one query, not one per node; bounded, as the names come
# from clients.
MAX_MISSING = 10_000


@dataclass(frozen=True, slots=True)
class Missing:
    """A model that does not exist; ``message`` says so (with close names)."""

    message: str


class ReadModel:
    def __init__(
        self,
        db: Database,
        *,
        poll_s: float = 1.0,
        listen: bool = True,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        """``on_drop``: called after every drop (the API clears its whole-answer
        cache, which must not outlive what it was computed from)."""
        self.db = db
        self.on_drop = on_drop
        self.poll_s = poll_s
        self.sqlite = db.url.get_backend_name() == "sqlite"
        self._listen = listen and not self.sqlite
        self._views: dict[str, ModelView | Missing] = {}
        self._lock = threading.Lock()
        self._load_locks: dict[str, threading.Lock] = {}
        # Bumped per model by each drop of it, and for all by a full drop.
        self._epoch: dict[str, int] = {}
        self._all_epoch = 0
        self._generation: int | None = None
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Any = None  # the listener's psycopg connection, under _conn_lock
        self._fd: int | None = None
        self._conn_lock = threading.Lock()
        self.listening = False
        self.loads = 0
        self.drops = 0

    # --- reads ---------------------------------------------------------------------------

    def peek(self, name: str) -> ModelView | Missing | None:
        """From memory (None: not held; ``get`` loads it), after applying the
        changes this process has been told of."""
        if self.sqlite:
            self._check_generation()
        else:
            self._catch_up()
        return self._views.get(name)

    def get(self, name: str) -> ModelView | Missing:
        """Held or loaded (blocking: call it in a worker thread). One thread
        loads a model while the others asking for it wait."""
        view = self.peek(name)
        if view is not None:
            return view
        with self._lock:
            lock = self._load_locks.setdefault(name, threading.Lock())
        with lock:
            view = self._views.get(name)
            if view is not None:
                return view
            epoch = self._epoch_of(name)
            loaded = load_models(self.db, [name]).get(name)
            found: ModelView | Missing = (
                loaded if loaded is not None else Missing(_missing_message(self.db, name))
            )
            self.loads += 1
            with self._lock:
                self._load_locks.pop(name, None)
                # Held only while changes are followed (start()): an app run
                # without its lifespan reads the database every time.
                if self._started and self._epoch_of(name) == epoch:
                    if isinstance(found, Missing) and self._missing_count() >= MAX_MISSING:
                        self._forget_missing()
                    self._views[name] = found
            return found

    def _epoch_of(self, name: str) -> tuple[int, int]:
        return (self._all_epoch, self._epoch.get(name, 0))

    def _missing_count(self) -> int:
        return sum(1 for v in self._views.values() if isinstance(v, Missing))

    def _forget_missing(self) -> None:
        for k in [k for k, v in self._views.items() if isinstance(v, Missing)]:
            del self._views[k]

    def __len__(self) -> int:
        return sum(1 for v in self._views.values() if isinstance(v, ModelView))

    # --- keeping it current --------------------------------------------------------------

    def drop(self, names: list[str] | None) -> None:
        """Forget ``names`` (None: everything): the next resolve reads them again."""
        try:
            self._drop(names)
        finally:
            if self.on_drop is not None:
                self.on_drop()

    def _drop(self, names: list[str] | None) -> None:
        with self._lock:
            self.drops += 1
            if names is None:
                self._all_epoch += 1
                self._views.clear()
                return
            for name in names:
                self._epoch[name] = self._epoch.get(name, 0) + 1
                self._views.pop(name, None)
            if len(self._epoch) > 4 * MAX_MISSING + len(self._views):
                # Epochs only need to outlive loads in flight; a full drop's
                # epoch covers those whose counters are forgotten here.
                self._epoch.clear()
                self._all_epoch += 1

    def preload(self) -> int:
        """Read every model (an API process's start); returns how many."""
        t0 = time.perf_counter()
        n = 0
        for batch in load_all(self.db):
            with self._lock:
                epoch = self._all_epoch
            # A change notified while this batch was read: those models are
            # read again on demand instead.
            with self._lock:
                if epoch == self._all_epoch:
                    for name, view in batch.items():
                        if name not in self._epoch:
                            self._views.setdefault(name, view)
            n += len(batch)
        log.info("read model: %d model(s) in %.1f s", n, time.perf_counter() - t0)
        return n

    def start(self) -> None:
        """Begin following changes (PostgreSQL: a listener thread)."""
        self._generation = self._read_generation()
        self._started = True
        if not self._listen or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._follow, name="farm-read-model", daemon=True)
        self._thread.start()
        # Preloading while the listener connects would miss what changes
        # meanwhile: wait (briefly) for it to listen first.
        deadline = time.monotonic() + 5.0
        while not self.listening and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _read_generation(self) -> int | None:
        try:
            with self.db.session() as s:
                return s.scalar(
                    select(m.ReadModelGeneration.n).where(m.ReadModelGeneration.id == 1)
                )
        except Exception as exc:  # the database is down: the next poll tries again
            log.debug("read model: cannot read the generation: %s", exc)
            return None

    def _check_generation(self) -> None:
        n = self._read_generation()
        if n is not None and n != self._generation:
            if self._generation is not None:
                self.drop(None)
            self._generation = n

    # --- PostgreSQL: the notification channel ----------------------------------------------
    #
    # The listener connection is read by whoever gets there first: this
    # process's listener thread (waiting on its socket), or a resolve that
    # finds bytes waiting on it (``peek``): either applies what it read before
    # releasing ``_conn_lock``. So a notification that reached this process
    # before a resolve began is applied before that resolve reads the model.

    def _catch_up(self) -> None:
        """Apply what the listener connection holds, if anything may be pending."""
        fd = self._fd
        if fd is None:
            return
        if not self._conn_lock.locked():
            poller = poll()
            poller.register(fd, POLLIN)
            if not poller.poll(0):
                return
        try:
            self._apply_pending()
        except Exception as exc:  # the listener thread sees it too, and reconnects
            log.debug("read model: reading notifications failed: %s", exc)

    def _apply_pending(self) -> None:
        with self._conn_lock:
            conn = self._conn
            if conn is None:
                return
            pg = conn.pgconn
            pg.consume_input()
            names: set[str] = set()
            while (note := pg.notifies()) is not None:
                names.add(note.extra.decode())
            if names:
                self.drop(sorted(names))
            if pg.status != 0:  # CONNECTION_OK
                raise ConnectionError("the listener connection is closed")

    def _follow(self) -> None:
        import psycopg

        conninfo = self.db.url.set(drivername="postgresql").render_as_string(hide_password=False)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                # Keepalives: a connection cut without a FIN (a host gone) is
                # noticed in seconds, and the generation is polled meanwhile.
                with psycopg.connect(
                    conninfo,
                    autocommit=True,
                    connect_timeout=5,
                    keepalives=1,
                    keepalives_idle=5,
                    keepalives_interval=2,
                    keepalives_count=3,
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if self._generation is not None and self._read_generation() != self._generation:
                        # Changed while this thread was not listening.
                        self.drop(None)
                    fd = conn.pgconn.socket
                    with self._conn_lock:
                        self._conn, self._fd = conn, fd
                    self.listening = True
                    backoff = 0.5
                    poller = poll()
                    poller.register(fd, POLLIN | POLLERR | POLLHUP)
                    while not self._stop.is_set():
                        if poller.poll(self.poll_s * 1000):
                            self._apply_pending()
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning(
                    "read model: change notifications are down (%s); polling the "
                    "generation every %.1f s meanwhile",
                    exc,
                    self.poll_s,
                )
            finally:
                self.listening = False
                with self._conn_lock:
                    self._conn, self._fd = None, None
            deadline = time.monotonic() + backoff
            while time.monotonic() < deadline and not self._stop.is_set():
                self._check_generation()
                time.sleep(min(self.poll_s, backoff))
            backoff = min(backoff * 2, 10.0)


def _missing_message(db: Database, name: str) -> str:
    from registry.service.lifecycle import model_row

    try:
        with db.session() as s:
            model_row(s, name)
    except NotFound as exc:
        return str(exc)
    # Created between the two reads: the next resolve loads it.
    return f"model {name!r} was just created; ask again"
