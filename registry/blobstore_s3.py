"""The S3 blob store (``s3://BUCKET[/PREFIX]``): the guarantees of
registry.blobstore over boto3, which is imported when a store is opened.

Split out of registry/blobstore.py; callers keep importing
``registry.blobstore.S3BlobStore``. The bodies are as they were.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from farm.core.digests import validate_digest
from registry.blobstore import (
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_PRESIGN_EXPIRES_S,
    BlobInfo,
    BlobNotFound,
    BlobReader,
    BlobStore,
    BlobStoreError,
    _clip_range,
    _copy_hashing,
    _hash_file,
    _Readable,
    _verified_download,
    logger,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


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
