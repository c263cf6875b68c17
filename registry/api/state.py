"""What one API process holds: settings, database, blob store, key, caches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import cachetools

from farm.core.settings import Settings
from registry.auth import Authenticator
from registry.blobstore import DEFAULT_PRESIGN_EXPIRES_S, BlobStore
from registry.db import Database

from .read_model import ReadModel
from .signer import NameSigner

if TYPE_CHECKING:
    from .miss_builder import MissBuilder
    from .report_sink import ReportSink

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

Enqueue = Callable[[str], None]


class TTLCache(Generic[K, V]):
    """A small cache of values that may be a little stale (``ttl_s``).

    The entries live in a ``cachetools.TTLCache`` (LRU-bounded at
    ``max_entries``), kept past their freshness for as long as they may still
    be served stale; what is added here is what cachetools does not do:

    ``get_or_load`` is safe from many threads; only one of them loads a
    missing key while the others wait for it, so a fleet asking the same
    question at once costs the database one query per TTL, not thousands.
    Errors are not cached. When loading fails with one of ``stale_on``
    (the database is down), an entry that expired less than ``stale_s`` ago
    is served instead: a fleet keeps resolving through a database blip.
    """

    def __init__(self, ttl_s: float, *, max_entries: int = 4096, stale_s: float = 0.0,
                 stale_on: tuple[type[BaseException], ...] = ()) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.stale_s = stale_s
        self.stale_on = stale_on
        # key -> (fresh until, value); an entry stays for the stale window
        # (stale_s) and the stale-while-revalidate one (ttl_s) past freshness.
        self._data: cachetools.TTLCache[K, tuple[float, V]] = cachetools.TTLCache(
            maxsize=max_entries, ttl=max(ttl_s, 0.0) * 2 + stale_s, timer=time.monotonic)
        self._locks: dict[K, threading.Lock] = {}
        self._guard = threading.Lock()
        self._generation = 0
        # key -> (when its refresh began, generation then); see lookup()
        self._refreshing: dict[K, tuple[float, int]] = {}

    def _entry(self, key: K) -> tuple[float, V] | None:
        with self._guard:  # cachetools' caches are not thread-safe
            return self._data.get(key)

    def peek(self, key: K) -> tuple[bool, V | None]:
        entry = self._entry(key)
        if entry is not None and entry[0] > time.monotonic():
            return True, entry[1]
        return False, None

    def put(self, key: K, value: V) -> None:
        if self.ttl_s <= 0:
            return
        with self._guard:
            self._data[key] = (time.monotonic() + self.ttl_s, value)

    def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        hit, value = self.peek(key)
        if hit:
            return value  # type: ignore[return-value]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            hit, value = self.peek(key)
            if hit:
                return value  # type: ignore[return-value]
            try:
                fresh = load()
            except self.stale_on as exc:
                entry = self._entry(key)
                if entry is None or entry[0] + self.stale_s < time.monotonic():
                    raise
                log.warning("serving a stale cache entry for %r: %s", key, exc)
                return entry[1]
            self.put(key, fresh)
        with self._guard:
            if len(self._locks) > self.max_entries:
                self._locks.clear()
        return fresh

    def invalidate(self, predicate: Callable[[K], bool] | None = None) -> None:
        with self._guard:
            # A refresh that began before this must not store what it computed.
            self._generation += 1
            if predicate is None:
                self._data.clear()
            else:
                for key in [k for k in self._data if predicate(k)]:
                    self._data.pop(key, None)

    # Stale-while-revalidate, for a cache used from the event loop only (the
    # resolve answers): one caller refreshes an expired entry while the others
    # are served the old one.

    def has(self, key: K) -> bool:
        """Whether there is an entry, fresh or not."""
        return self._entry(key) is not None

    def lookup(self, key: K) -> tuple[V | None, bool]:
        """``(value, False)``: serve this (fresh, or stale while another caller
        refreshes it, for at most ``ttl_s`` past its expiry). ``(None, True)``:
        the caller refreshes it and then calls ``refreshed(key, value or None)``."""
        now = time.monotonic()
        entry = self._entry(key)
        if entry is not None:
            if entry[0] > now:
                return entry[1], False
            refreshing = self._refreshing.get(key)
            if (refreshing is not None and now - refreshing[0] < self.ttl_s
                    and now < entry[0] + self.ttl_s):
                return entry[1], False
        if len(self._refreshing) >= self.max_entries:
            self._refreshing.clear()
        self._refreshing[key] = (now, self._generation)
        return None, True

    @property
    def generation(self) -> int:
        """Bumped by every ``invalidate``."""
        return self._generation

    def refreshed(self, key: K, value: V | None, *, generation: int | None = None) -> None:
        """The refresh ``lookup`` asked for is over: ``value`` is stored unless
        None or the cache was invalidated meanwhile. A caller that computed a
        value without ``lookup`` passes the ``generation`` it began in."""
        if generation is None:
            refreshing = self._refreshing.pop(key, None)
            generation = refreshing[1] if refreshing is not None else self._generation
        if value is not None and generation == self._generation:
            self.put(key, value)


@dataclass
class AppState:
    settings: Settings
    db: Database
    store: BlobStore
    enqueue: Enqueue
    signer: NameSigner
    auth: Authenticator
    # every model's resolve candidates, kept current from the database
    read_model: ReadModel
    # whole resolve answers by (query string, Host); see middleware.ResponseCache
    resolve_responses: TTLCache[tuple[bytes, bytes], Any] = field(
        default_factory=lambda: TTLCache(0.0))
    # S3 downloads: digests known to have a row, so a redirect is not a query
    known_digests: TTLCache[str, bool] = field(default_factory=lambda: TTLCache(60.0))
    # S3 downloads: presigned URLs by digest, handed out for a twelfth of their
    # life (so each still has at least 55 of its 60 minutes when given)
    presigned: TTLCache[str, str | None] = field(
        default_factory=lambda: TTLCache(DEFAULT_PRESIGN_EXPIRES_S / 12))
    # local blob files whose bytes matched their digest: digest -> the file's
    # (inode, size, mtime, ctime) then; served again unhashed while unchanged
    verified_files: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    # resolve misses recorded lately, so a fleet missing at once is one row per few seconds
    recent_misses: TTLCache[tuple[Any, ...], bool] = field(
        default_factory=lambda: TTLCache(5.0))
    # node reports (POST /v1/reports) and build on miss; set by create_app
    reports: ReportSink = field(init=False)
    miss_builder: MissBuilder = field(init=False)

    @property
    def heartbeat_max_age_s(self) -> float:
        return 3.0 * self.settings.heartbeat_s
