"""Content-addressed blob storage: artifact bytes keyed by their sha256.

A blob's key is the hash of its bytes, so the bytes under a key can never change
(pypa/warehouse stores files the same way). Stores are chosen by URL scheme from
a registry (as mlflow does for artifact repositories)::

    store = open_blob_store("file:///var/lib/farm/blobs")
    store = open_blob_store("s3://bucket/prefix", endpoint_url="http://minio:9000")

Guarantees every store keeps:

- a write is atomic: nothing is visible under a digest until all of its bytes
  are (a temp file renamed into place locally; a single S3 PUT or a completed
  multipart upload on S3);
- a full read verifies the digest: ``get_to_file`` never leaves unverified bytes
  at its destination and ``open`` raises ``BlobCorrupt`` at end of stream;
- a digest is exactly 64 lowercase hex characters, checked before any path or
  key is built from it, which is what keeps ``../`` out of paths and keys.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlparse

from farm.core.digests import fsync_dir, sha256_file, validate_digest

logger = logging.getLogger(__name__)

CHUNK_SIZE = 1024 * 1024
DEFAULT_MULTIPART_THRESHOLD = 8 * 1024 * 1024
DEFAULT_PRESIGN_EXPIRES_S = 3600


class BlobStoreError(Exception):
    """Base class for blob store errors."""


class BlobNotFound(BlobStoreError, LookupError):
    def __init__(self, digest: str, where: str) -> None:
        super().__init__(f"blob sha256:{digest} not found in {where}")
        self.digest = digest


class BlobCorrupt(BlobStoreError):
    def __init__(self, digest: str, actual: str, *, size: int, expected_size: int | None) -> None:
        detail = f"got sha256:{actual}, {size} bytes"
        if expected_size is not None and expected_size != size:
            detail += f" (expected {expected_size} bytes)"
        super().__init__(f"blob sha256:{digest} is corrupt: {detail}")
        self.digest = digest
        self.actual = actual


class UnknownBlobScheme(BlobStoreError, ValueError):
    pass


class RangeNotSatisfiable(BlobStoreError, ValueError):
    """The requested byte range lies outside the blob (HTTP 416)."""

    def __init__(self, start: int, end: int | None, size: int) -> None:
        shown = "" if end is None else str(end)
        super().__init__(f"range bytes={start}-{shown} not satisfiable for a {size}-byte blob")
        self.size = size


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int


class _Readable(Protocol):
    def read(self, n: int = ..., /) -> bytes: ...


class BlobReader(io.RawIOBase):
    """A read-only stream over a blob (or a byte range of it).

    Over a whole blob it hashes what passes through and raises ``BlobCorrupt``
    at end of stream if the bytes were not the digest's: a server streaming it
    to a client then aborts the response instead of completing it with wrong
    bytes. A range cannot be verified on its own, so range readers do not try.
    """

    def __init__(
        self,
        raw: _Readable,
        *,
        digest: str,
        length: int,
        verify: bool,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._raw = raw
        self._digest = digest
        self._length = length
        self._remaining = length
        self._hasher = hashlib.sha256() if verify else None
        self._seen = 0
        self._on_close = on_close

    @property
    def length(self) -> int:
        """Bytes this reader yields in total (the blob's size, or the range's)."""
        return self._length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._remaining)
        data = self._raw.read(want) if want else b""
        n = len(data)
        view[:n] = data
        self._remaining -= n
        self._seen += n
        if self._hasher is not None:
            self._hasher.update(data)
            if n == 0 and len(view) > 0:
                self._check()
        return n

    def readall(self) -> bytes:
        # io's default reads in 8 KiB steps; blobs are megabytes.
        parts = []
        while chunk := self.read(CHUNK_SIZE):
            parts.append(chunk)
        return b"".join(parts)

    def _check(self) -> None:
        assert self._hasher is not None
        actual = self._hasher.hexdigest()
        # Checked once: a second read at EOF must not hash an empty tail again.
        self._hasher = None
        if actual != self._digest or self._seen != self._length:
            logger.warning("blob %s failed verification while streaming", self._digest)
            raise BlobCorrupt(self._digest, actual, size=self._seen, expected_size=self._length)

    def iter_chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """Yield the stream in chunks; closes it at the end."""
        try:
            while True:
                chunk = self.read(chunk_size)
                if not chunk:
                    return
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            try:
                close = getattr(self._raw, "close", None)
                if close is not None:
                    close()
                if self._on_close is not None:
                    self._on_close()
            finally:
                super().close()


def _clip_range(start: int, end: int | None, size: int) -> tuple[int, int]:
    """HTTP Range semantics: ``end`` inclusive, clipped to the blob; returns [start, stop)."""
    if start < 0 or start >= size or (end is not None and end < start):
        raise RangeNotSatisfiable(start, end, size)
    stop = size if end is None else min(end + 1, size)
    return start, stop


def _hash_file(path: Path) -> BlobInfo:
    return BlobInfo(sha256_file(path, chunk_size=CHUNK_SIZE), path.stat().st_size)


def _copy_hashing(src: _Readable, dst: BinaryIO) -> BlobInfo:
    hasher = hashlib.sha256()
    size = 0
    while chunk := src.read(CHUNK_SIZE):
        hasher.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return BlobInfo(hasher.hexdigest(), size)


class _TempFile:
    """A temp file that is removed unless it was committed (renamed into place)."""

    def __init__(self, directory: Path, *, prefix: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".part")
        self.path = Path(name)
        self.file: BinaryIO = os.fdopen(fd, "w+b")
        self._committed = False

    def finish(self, *, mode: int) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        os.fchmod(self.file.fileno(), mode)

    def commit(self, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path, dest)
        self._committed = True
        fsync_dir(dest.parent)

    def __enter__(self) -> _TempFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        # Only unlink a name this object still owns: once renamed away, the
        # name could already belong to another writer's temp file.
        if not self._committed:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class BlobStore(abc.ABC):
    """Where artifact bytes live, keyed by sha256."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL this store was opened with (``file:///...``, ``s3://...``)."""

    @abc.abstractmethod
    def put_stream(self, stream: _Readable) -> BlobInfo:
        """Store everything ``stream.read()`` yields; idempotent per digest."""

    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo:
        with open(path, "rb") as f:
            return self.put_stream(f)

    def put_bytes(self, data: bytes) -> BlobInfo:
        return self.put_stream(io.BytesIO(data))

    @abc.abstractmethod
    def exists(self, digest: str) -> bool: ...

    @abc.abstractmethod
    def size(self, digest: str) -> int:
        """The blob's size in bytes; ``BlobNotFound`` if absent."""

    @abc.abstractmethod
    def open(self, digest: str, *, start: int = 0, end: int | None = None) -> BlobReader:
        """Stream a blob, or the range ``start``..``end`` (inclusive, as HTTP Range).

        A whole-blob reader verifies the digest at end of stream; a range reader
        cannot. Raises ``RangeNotSatisfiable`` for a range outside the blob.
        """

    def read_range(self, digest: str, start: int, end: int | None = None) -> bytes:
        """Bytes ``start``..``end`` inclusive (HTTP Range semantics, clipped to the blob)."""
        with self.open(digest, start=start, end=end) as reader:
            return reader.read()

    def read_bytes(self, digest: str) -> bytes:
        """The whole blob, verified; for small blobs."""
        with self.open(digest) as reader:
            return reader.read()

    @abc.abstractmethod
    def get_to_file(
        self, digest: str, dest_path: str | os.PathLike[str], *, mode: int = 0o644
    ) -> int:
        """Download to ``dest_path`` atomically after verifying the digest; returns the size.

        On ``BlobCorrupt`` or any other failure nothing new is left at ``dest_path``.
        """

    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove a blob; removing an absent blob is not an error."""

    def presigned_url(
        self, digest: str, *, expires_s: int = DEFAULT_PRESIGN_EXPIRES_S
    ) -> str | None:
        """A URL a client can GET the bytes from directly, or None if the store has none."""
        validate_digest(digest)
        return None

    def local_path(self, digest: str) -> Path | None:
        """The blob's file when the store is a local directory, so a server can sendfile it."""
        validate_digest(digest)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalBlobStore(BlobStore):
    """Blobs as read-only files at ``<root>/sha256/ab/cdef...``.

    Writes go to ``<root>/tmp`` and are renamed into place: the digest of a
    streamed write is only known at its end, the rename stays on one file
    system so it is atomic, and temp files never show up in the ``sha256/``
    tree that readers and garbage collection walk.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self._objects = self.root / "sha256"
        self._tmp = self.root / "tmp"

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def path_for(self, digest: str) -> Path:
        validate_digest(digest)
        return self._objects / digest[:2] / digest[2:]

    def local_path(self, digest: str) -> Path | None:
        return self.path_for(digest)

    def put_stream(self, stream: _Readable) -> BlobInfo:
        with _TempFile(self._tmp, prefix=".put-") as tmp:
            info = _copy_hashing(stream, tmp.file)
            # Read-only so nothing rewrites a blob in place by accident.
            tmp.finish(mode=0o444)
            final = self.path_for(info.digest)
            try:
                present = final.stat().st_size == info.size
            except FileNotFoundError:
                present = False
            if present:
                logger.debug("blob %s already present", info.digest)
                return info
            # A same-digest file of the wrong size is a damaged copy: replacing
            # it with verified bytes repairs it.
            tmp.commit(final)
        logger.debug("stored blob %s (%d bytes) at %s", info.digest, info.size, final)
        return info

    def exists(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path_for(digest).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(digest, self.url) from None

    def _open_raw(self, digest: str) -> BinaryIO:
        try:
            return open(self.path_for(digest), "rb")
        except FileNotFoundError:
            raise BlobNotFound(digest, self.url) from None

    def open(self, digest: str, *, start: int = 0, end: int | None = None) -> BlobReader:
        f = self._open_raw(digest)
        try:
            size = os.fstat(f.fileno()).st_size
            if start == 0 and end is None:
                return BlobReader(f, digest=digest, length=size, verify=True)
            lo, hi = _clip_range(start, end, size)
            f.seek(lo)
            return BlobReader(f, digest=digest, length=hi - lo, verify=False)
        except BaseException:
            f.close()
            raise

    def get_to_file(
        self, digest: str, dest_path: str | os.PathLike[str], *, mode: int = 0o644
    ) -> int:
        with self._open_raw(digest) as src:
            expected = os.fstat(src.fileno()).st_size
            return _verified_download(
                digest,
                Path(dest_path),
                mode=mode,
                expected_size=expected,
                fill=lambda f: _copy_hashing(src, f),
            )

    def delete(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_for(digest).unlink()


def _verified_download(
    digest: str,
    dest: Path,
    *,
    mode: int,
    expected_size: int | None,
    fill: Callable[[BinaryIO], BlobInfo | None],
) -> int:
    """Write to a temp file beside ``dest``, verify, then rename into place.

    ``fill`` returns the hash it computed while writing, or None when the bytes
    arrived out of order (parallel ranged GETs) and must be hashed afterwards.
    """
    validate_digest(digest)
    with _TempFile(dest.parent, prefix=f".{dest.name}.") as tmp:
        info = fill(tmp.file)
        tmp.finish(mode=mode)
        if info is None:
            info = _hash_file(tmp.path)
        if info.digest != digest or (expected_size is not None and info.size != expected_size):
            logger.warning("blob %s failed verification on download", digest)
            raise BlobCorrupt(digest, info.digest, size=info.size, expected_size=expected_size)
        tmp.commit(dest)
    return info.size


BlobStoreFactory = Callable[..., BlobStore]

_SCHEMES: dict[str, BlobStoreFactory] = {}


def register_blob_scheme(scheme: str, factory: BlobStoreFactory) -> None:
    """Make ``open_blob_store`` open ``scheme://...`` URLs with ``factory(url, **kw)``."""
    _SCHEMES[scheme] = factory


def known_schemes() -> list[str]:
    return sorted(_SCHEMES)


def open_blob_store(url: str, **kw: Any) -> BlobStore:
    """Open the store a URL names; options go to the scheme's factory."""
    scheme = urlparse(url).scheme
    factory = _SCHEMES.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in known_schemes())
        raise UnknownBlobScheme(
            f"unknown blob store scheme {scheme or '(none)'!r} in {url!r}; known schemes: {known}"
        )
    return factory(url, **kw)


def _open_file(url: str, **kw: Any) -> LocalBlobStore:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost") or not parsed.path:
        raise ValueError(f"file blob store URL must be file:///ABSOLUTE/PATH, got {url!r}")
    return LocalBlobStore(unquote(parsed.path), **kw)


def _open_s3(url: str, **kw: Any) -> S3BlobStore:
    parsed = urlparse(url)
    return S3BlobStore(parsed.netloc, unquote(parsed.path), **kw)


register_blob_scheme("file", _open_file)
register_blob_scheme("s3", _open_s3)

# The S3 store lives in its own module (it stands on everything above, and
# boto3 is imported only when one is opened); imported here so that
# ``registry.blobstore.S3BlobStore`` is the one name callers use.
from registry.blobstore_s3 import S3BlobStore  # noqa: E402

__all__ = [
    "BlobCorrupt",
    "BlobInfo",
    "BlobNotFound",
    "BlobReader",
    "BlobStore",
    "BlobStoreError",
    "LocalBlobStore",
    "RangeNotSatisfiable",
    "S3BlobStore",
    "UnknownBlobScheme",
    "known_schemes",
    "open_blob_store",
    "register_blob_scheme",
    "validate_digest",
]
