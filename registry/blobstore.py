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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol
from urllib.parse import unquote, urlparse

from farm.core.digests import fsync_dir, sha256_file, validate_digest

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

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


class S3BlobStore(BlobStore):
    """Blobs as S3 objects at ``<prefix>/sha256/<digest>``.

    Uploads go through boto3's transfer manager: multipart above
    ``multipart_threshold``, parts in parallel. An object only appears under its
    key when its PUT or its multipart upload completes, so writes are atomic by
    S3's own semantics. Each upload asks S3 for a SHA256 checksum (for a single
    PUT that is the digest itself, verified by the server on arrival) and records
    the hex digest as ``x-amz-meta-sha256``; reads verify regardless, since not
    every S3 implementation checks checksums (moto does not).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        client: S3Client | None = None,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize: int = DEFAULT_MULTIPART_THRESHOLD,
        max_concurrency: int = 8,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        if not bucket:
            raise ValueError("S3 blob store needs a bucket: s3://BUCKET[/PREFIX]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if endpoint_url is None:
            endpoint_url = os.environ.get("S3_ENDPOINT_URL") or None
        self.endpoint_url = endpoint_url
        self._client = client or _make_s3_client(
            endpoint_url=endpoint_url, region_name=region_name, max_pool=max_concurrency + 2
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        self._spool_dir = spool_dir

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def client(self) -> S3Client:
        return self._client

    def key_for(self, digest: str) -> str:
        validate_digest(digest)
        return f"{self.prefix}/sha256/{digest}" if self.prefix else f"sha256/{digest}"

    def _head(self, digest: str) -> dict[str, Any] | None:
        try:
            return dict(self._client.head_object(Bucket=self.bucket, Key=self.key_for(digest)))
        except Exception as e:
            if _is_not_found(e):
                return None
            _raise_mapped(e, self.bucket)
            raise

    def exists(self, digest: str) -> bool:
        return self._head(digest) is not None

    def size(self, digest: str) -> int:
        head = self._head(digest)
        if head is None:
            raise BlobNotFound(digest, self.url)
        return int(head["ContentLength"])

    def _upload(
        self, info: BlobInfo, *, path: Path | None = None, data: bytes | None = None
    ) -> None:
        extra = {"Metadata": {"sha256": info.digest}, "ChecksumAlgorithm": "SHA256"}
        key = self.key_for(info.digest)
        try:
            if path is not None:
                self._client.upload_file(
                    str(path), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                )
            else:
                assert data is not None
                self._client.upload_fileobj(
                    io.BytesIO(data), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                )
        except Exception as e:
            _raise_mapped(e, self.bucket)
            raise
        logger.debug(
            "stored blob %s (%d bytes) at s3://%s/%s", info.digest, info.size, self.bucket, key
        )

    def _present(self, info: BlobInfo) -> bool:
        head = self._head(info.digest)
        return head is not None and int(head["ContentLength"]) == info.size

    def put_file(self, path: str | os.PathLike[str]) -> BlobInfo:
        # The key is the digest, so the file is hashed before the upload starts;
        # a file that changes in between is caught by the stat check below.
        path = Path(path)
        before = path.stat()
        info = _hash_file(path)
        if self._present(info):
            return info
        self._upload(info, path=path)
        after = path.stat()
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            self.delete(info.digest)
            raise BlobStoreError(f"{path} changed while it was being stored; nothing was kept")
        return info

    def put_bytes(self, data: bytes) -> BlobInfo:
        info = BlobInfo(hashlib.sha256(data).hexdigest(), len(data))
        if not self._present(info):
            self._upload(info, data=data)
        return info

    def put_stream(self, stream: _Readable) -> BlobInfo:
        # Spooled to a private file: the digest (the key) is only known at the
        # end, and the transfer manager wants a file it can read parts of in parallel.
        with tempfile.TemporaryDirectory(dir=self._spool_dir, prefix="farm-blob-") as d:
            spool = Path(d) / "blob"
            with open(spool, "wb") as f:
                info = _copy_hashing(stream, f)
            if not self._present(info):
                self._upload(info, path=spool)
        return info

    def _get(self, digest: str, **kw: Any) -> dict[str, Any]:
        try:
            return dict(self._client.get_object(Bucket=self.bucket, Key=self.key_for(digest), **kw))
        except Exception as e:
            if _is_not_found(e):
                raise BlobNotFound(digest, self.url) from None
            _raise_mapped(e, self.bucket)
            raise

    def open(self, digest: str, *, start: int = 0, end: int | None = None) -> BlobReader:
        if start == 0 and end is None:
            resp = self._get(digest)
            length = int(resp["ContentLength"])
            return BlobReader(resp["Body"], digest=digest, length=length, verify=True)
        lo, hi = _clip_range(start, end, self.size(digest))
        resp = self._get(digest, Range=f"bytes={lo}-{hi - 1}")
        return BlobReader(resp["Body"], digest=digest, length=hi - lo, verify=False)

    def get_to_file(
        self, digest: str, dest_path: str | os.PathLike[str], *, mode: int = 0o644
    ) -> int:
        expected = self.size(digest)
        key = self.key_for(digest)

        def fill(f: BinaryIO) -> None:
            # Parallel ranged GETs write parts out of order; hashed afterwards.
            try:
                self._client.download_fileobj(self.bucket, key, f, Config=self._transfer)
            except Exception as e:
                if _is_not_found(e):
                    raise BlobNotFound(digest, self.url) from None
                _raise_mapped(e, self.bucket)
                raise

        return _verified_download(
            digest, Path(dest_path), mode=mode, expected_size=expected, fill=fill
        )

    def delete(self, digest: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.key_for(digest))
        except Exception as e:
            if not _is_not_found(e):
                _raise_mapped(e, self.bucket)
                raise

    def presigned_url(
        self, digest: str, *, expires_s: int = DEFAULT_PRESIGN_EXPIRES_S
    ) -> str | None:
        return self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self.key_for(digest)},
            ExpiresIn=expires_s,
        )


_client_lock = threading.Lock()


def _make_s3_client(
    *, endpoint_url: str | None, region_name: str | None, max_pool: int
) -> S3Client:
    import boto3
    from botocore.config import Config

    config = Config(
        # MinIO and moto serve buckets by path, not by virtual host.
        s3={"addressing_style": "path"} if endpoint_url else {},
        signature_version="s3v4",
        retries={"max_attempts": 5, "mode": "standard"},
        max_pool_connections=max_pool,
    )
    # boto3 sessions are not thread-safe to create clients from concurrently.
    with _client_lock:
        session = boto3.session.Session()
        return session.client(
            "s3", endpoint_url=endpoint_url, region_name=region_name, config=config
        )


def _error_code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _is_not_found(e: BaseException) -> bool:
    return _error_code(e) in {"404", "NoSuchKey", "NotFound"}


def _raise_mapped(e: BaseException, bucket: str) -> None:
    """Raise a clearer error for S3 failures a caller can act on; else return."""
    if _error_code(e) == "NoSuchBucket":
        raise BlobStoreError(f"S3 bucket {bucket!r} does not exist") from e


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
