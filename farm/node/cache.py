"""A fleet node's local, content-addressed artifact cache.

Blobs live under ``ROOT/blobs/<sha256>`` and never change under their name: a
file is only ever written to a temp file in the same directory, hashed while
it is written, and moved into place with ``os.replace`` once its sha256 equals
the digest it is stored under. A reader therefore sees a whole, correct blob or
nothing.

Several processes on one node may share a cache (several ranks loading one
model). Each digest has a lock file, ``ROOT/locks/<sha256>.lock``, taken with
``fcntl.flock`` (the one lock in the farm not taken with ``filelock``: readers
share it, and filelock's locks are exclusive only; its ReadWriteLock is an
SQLite database, which eviction could not unlink under a holder as it does
here):

* a writer holds it exclusively while it downloads, so a second process asking
  for the same digest waits, then finds the blob in place and never starts a
  second download (``put_stream`` only iterates its chunks when it must);
* a reader that needs the file to stay put (between ``get`` and loading it)
  holds it shared with ``hold()``;
* eviction deletes a blob only if it can take the lock exclusively without
  waiting, so it never removes a file that someone is writing or holding.

Lock files of evicted blobs are removed too; ``_locked`` re-checks after
locking that its lock file is still the one on disk, so a lock taken on an
unlinked file is never trusted.

Integrity: ``put_stream`` hashes what it writes. ``get`` re-hashes a blob the
first time this process uses it (``verify=True``, the default) and trusts it
for the rest of the process; a blob that fails is deleted and reported as
absent. That catches truncated files and leftovers of other tools. After a
hash the cache keeps a marker, ``ROOT/verified/<sha256>``, with the blob's
device, inode, size and ctime: a later process whose blob still has all four
takes the hash as done (``farm prefetch`` at provisioning hashes once, not
every process start). Any write to the file, a ``chmod`` or a replacement
changes its ctime, which no one but the kernel sets, so the next use hashes
it again; bit rot, which changes nothing on the inode, is then caught only by
a process that hashes (a new blob, or a deleted marker). It does not defend
against someone who can write to the cache directory while this process runs:
such a user can already run code as the node's user. ``verify=False`` checks
only that the blob is non-empty and, when the caller passes ``size``, its size.

Size: after each write the cache evicts least-recently-used blobs (by mtime,
which ``get`` bumps, because ``atime`` is unreliable on ``relatime`` and
``noatime`` mounts) until it holds at most ``max_bytes``. The blob just
written is never evicted, even when it alone exceeds the bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from farm.core import digests
from farm.core.digests import fsync_dir, sha256_file

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
# A temp file this old whose digest lock is free belongs to a writer that died.
STALE_TMP_S = 3600.0
_HASH_CHUNK = 1 << 20


# Files this process hashed, by (st_dev, st_ino, st_size, st_ctime_ns), and
# their sha256: farm.node.verify.check_file then need not hash a blob the
# cache checked a moment before (process-wide: every cache object shares it).
_HASHED: dict[tuple[int, int, int, int], str] = {}
_HASHED_LOCK = threading.Lock()


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def note_hashed(st: os.stat_result, digest: str) -> None:
    """Record that the file with stat ``st`` hashes to ``digest``."""
    with _HASHED_LOCK:
        _HASHED[_stat_key(st)] = digest


def known_digest(st: os.stat_result) -> str | None:
    """The sha256 this process found for the file with stat ``st``, or None
    (never hashed here, or changed since: its ctime differs)."""
    with _HASHED_LOCK:
        return _HASHED.get(_stat_key(st))


class CacheError(Exception):
    """Base of the cache's errors."""


class InvalidDigest(CacheError, ValueError):
    """Not a sha256 hex digest: refused before it can name a path."""


class CacheCorrupt(CacheError):
    """The bytes offered for a digest do not hash to it; nothing was stored."""


def validate_digest(digest: object) -> str:
    """Return ``digest`` if it is 64 lowercase hex characters, else raise ``InvalidDigest``."""
    try:
        return digests.validate_digest(digest)
    except digests.InvalidDigest as exc:
        raise InvalidDigest(str(exc)) from None


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    path: Path
    size: int
    mtime: float


class ArtifactCache:
    """A directory of blobs named by their sha256, bounded to ``max_bytes``."""

    def __init__(
        self, root: str | os.PathLike[str], max_bytes: int, *, verify: bool = True
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.verify = verify
        self._blobs = self.root / "blobs"
        self._locks = self.root / "locks"
        self._markers = self.root / "verified"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        # (digest, st_dev, st_ino, st_size) of blobs this process has hashed.
        # Blobs are only created by os.replace, so a new file is a new inode.
        self._verified: set[tuple[str, int, int, int]] = set()
        self._mutex = threading.Lock()

    @classmethod
    def from_settings(cls) -> ArtifactCache:
        from farm.core.settings import get_settings

        s = get_settings()
        return cls(s.resolved_cache_dir(), s.client_cache_max_bytes)

    # --- paths and locks ----------------------------------------------------

    def path_for(self, digest: str) -> Path:
        """Where the blob for ``digest`` lives (whether or not it is there)."""
        return self._blobs / validate_digest(digest)

    def _lock_path(self, digest: str) -> Path:
        return self._locks / f"{digest}.lock"

    @contextlib.contextmanager
    def _locked(self, digest: str, *, exclusive: bool, blocking: bool = True) -> Iterator[bool]:
        """Hold the digest's flock; yields False (and holds nothing) if
        ``blocking`` is False and someone else has it."""
        path = self._lock_path(digest)
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if not blocking:
            op |= fcntl.LOCK_NB
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, op)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    yield False
                    return
                raise
            # Eviction unlinks lock files while holding them: if ours was
            # unlinked (or replaced) while we waited, our lock guards nothing.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield True
        finally:
            os.close(fd)

    # --- reads --------------------------------------------------------------

    # --- verified markers (see the module docstring) ----------------------

    def _marker_path(self, digest: str) -> Path:
        return self._markers / digest

    def _marked(self, digest: str, st: os.stat_result) -> bool:
        try:
            text = self._marker_path(digest).read_text()
        except OSError:
            return False
        return text.strip() == " ".join(map(str, _stat_key(st)))

    def _mark(self, digest: str, path: Path) -> None:
        """Record (in this process and on disk) that ``path`` hashed to
        ``digest``, as it is now. Best effort: without a marker the next
        process hashes again."""
        try:
            st = path.stat()
            note_hashed(st, digest)
            self._markers.mkdir(exist_ok=True)
            final = self._marker_path(digest)
            tmp = final.with_name(f".{digest}.{secrets.token_hex(6)}{_TMP_SUFFIX}")
            tmp.write_text(" ".join(map(str, _stat_key(st))))
            os.replace(tmp, final)
        except OSError as exc:
            log.debug("cache: no verified marker for %s: %s", digest, exc)

    def _unmark(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            self._marker_path(digest).unlink()

    def _check(self, digest: str, path: Path, size: int | None) -> bool:
        """True if the blob at ``path`` is good; a bad one is deleted.
        Call with the digest's lock held (shared or exclusive)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        key = (digest, st.st_dev, st.st_ino, st.st_size)
        bad = ""
        if size is not None and st.st_size != size:
            bad = f"size {st.st_size} != expected {size}"
        elif st.st_size == 0:
            bad = "empty file"
        elif self.verify and key not in self._verified:
            if self._marked(digest, st):
                note_hashed(st, digest)
            else:
                actual = sha256_file(path)
                if actual != digest:
                    bad = f"sha256 is {actual}"
                else:
                    self._mark(digest, path)
        if bad:
            log.warning("cache: dropping bad blob %s (%s)", digest, bad)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._unmark(digest)
            return False
        with self._mutex:
            self._verified.add(key)
        return True

    def _touch(self, path: Path) -> None:
        # The LRU clock (see the module docstring). It changes the ctime, so
        # a blob this process has verified gets its marker renewed.
        with contextlib.suppress(OSError):
            os.utime(path)
        if self.verify:
            digest = path.name
            try:
                st = path.stat()
            except OSError:
                return
            with self._mutex:
                verified = (digest, st.st_dev, st.st_ino, st.st_size) in self._verified
            if verified:
                self._mark(digest, path)

    def get(self, digest: str, *, size: int | None = None) -> Path | None:
        """The blob's path if it is cached and good, else None.

        The file can be evicted by another process after this returns; use
        ``hold()`` when it must stay until it has been read.
        """
        path = self.path_for(digest)
        if not path.exists():
            return None
        with self._locked(digest, exclusive=False):
            if not self._check(digest, path, size):
                return None
            self._touch(path)
            return path

    @contextlib.contextmanager
    def hold(self, digest: str, *, size: int | None = None) -> Iterator[Path | None]:
        """Like ``get``, but the blob cannot be evicted inside the ``with``."""
        path = self.path_for(digest)
        with self._locked(digest, exclusive=False):
            if not self._check(digest, path, size):
                yield None
                return
            self._touch(path)
            yield path

    def __contains__(self, digest: object) -> bool:
        try:
            return self.path_for(validate_digest(digest)).exists()
        except InvalidDigest:
            return False

    # --- writes -------------------------------------------------------------

    def put_stream(self, digest: str, chunks: Iterable[bytes], *, size: int | None = None) -> Path:
        """Store the bytes ``chunks`` yields as the blob ``digest`` and return its path.

        If the blob is already cached (perhaps written by another process that
        held the lock while this one waited) ``chunks`` is closed unread: pass
        a generator that opens its download lazily and nothing is fetched
        twice. Raises ``CacheCorrupt``, leaving nothing behind, when the bytes
        hash to anything else or exceed ``size``.
        """
        final = self.path_for(digest)
        try:
            with self._locked(digest, exclusive=True):
                if self._check(digest, final, size):
                    self._touch(final)
                    return final
                self._remove_temps(digest, max_age_s=0.0)
                self._write(digest, final, chunks, size)
        finally:
            close = getattr(chunks, "close", None)
            if callable(close):
                close()
        self.evict(keep={digest})
        return final

    def put_file(self, digest: str, src: str | os.PathLike[str]) -> Path:
        """Copy a local file into the cache (verified like ``put_stream``)."""

        def read() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    yield chunk

        return self.put_stream(digest, read())

    def _write(self, digest: str, final: Path, chunks: Iterable[bytes], size: int | None) -> None:
        tmp = final.with_name(f".{digest}.{secrets.token_hex(6)}{_TMP_SUFFIX}")
        h = hashlib.sha256()
        written = 0
        try:
            with open(tmp, "xb") as f:
                for chunk in chunks:
                    if not chunk:
                        continue
                    written += len(chunk)
                    if size is not None and written > size:
                        raise CacheCorrupt(
                            f"blob {digest}: received more than the expected {size} bytes"
                        )
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            actual = h.hexdigest()
            if actual != digest:
                raise CacheCorrupt(
                    f"blob {digest}: the {written} bytes received hash to {actual}; refused"
                )
            if size is not None and written != size:
                raise CacheCorrupt(f"blob {digest}: received {written} bytes, expected {size}")
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        fsync_dir(self._blobs)
        st = final.stat()
        with self._mutex:
            self._verified.add((digest, st.st_dev, st.st_ino, st.st_size))
        if self.verify:
            self._mark(digest, final)

    def _remove_temps(self, digest: str, *, max_age_s: float) -> None:
        now = time.time()
        for p in self._blobs.glob(f".{digest}.*{_TMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime >= max_age_s:
                    p.unlink()

    # --- size -----------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Cached blobs, least recently used first."""
        out = []
        with os.scandir(self._blobs) as it:
            for e in it:
                if not digests.DIGEST_RE.fullmatch(e.name):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out.append(CacheEntry(e.name, Path(e.path), st.st_size, st.st_mtime))
        out.sort(key=lambda c: (c.mtime, c.digest))
        return out

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self, *, keep: Iterable[str] = ()) -> list[str]:
        """Delete least-recently-used blobs until the cache fits ``max_bytes``.

        Skips the digests in ``keep`` and any blob whose lock another process
        holds (it is being written or read). Returns the digests deleted.
        """
        keep = set(keep)
        self._sweep_temps()
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed: list[str] = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.digest in keep:
                continue
            with self._locked(e.digest, exclusive=True, blocking=False) as got:
                if not got:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    e.path.unlink()
                self._unmark(e.digest)
                # Unlinked while held: a process that opened the old lock file
                # notices (inode check in _locked) and retries on a new one.
                with contextlib.suppress(FileNotFoundError):
                    self._lock_path(e.digest).unlink()
            total -= e.size
            removed.append(e.digest)
        if removed:
            log.info("cache: evicted %d blob(s), %d bytes now cached", len(removed), total)
        if total > self.max_bytes:
            log.warning(
                "cache: %d bytes cached, above the %d-byte bound (blobs in use or just written)",
                total,
                self.max_bytes,
            )
        return removed

    def _sweep_temps(self) -> None:
        now = time.time()
        for p in self._blobs.glob(f".*{_TMP_SUFFIX}"):
            digest = p.name[1:].split(".", 1)[0]
            if not digests.DIGEST_RE.fullmatch(digest):
                continue
            try:
                if now - p.stat().st_mtime < STALE_TMP_S:
                    continue
            except FileNotFoundError:
                continue
            with self._locked(digest, exclusive=True, blocking=False) as got:
                if got:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
