"""One contract for every blob store: a local directory and S3 (moto over HTTP)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from registry import blobstore
from registry.blobstore import (
    BlobCorrupt,
    BlobInfo,
    BlobNotFound,
    BlobStore,
    LocalBlobStore,
    RangeNotSatisfiable,
    S3BlobStore,
    UnknownBlobScheme,
    open_blob_store,
)

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
# s3transfer never cuts parts below S3's 5 MiB minimum, so a 1 MiB threshold with
# 5 MiB parts and an 11 MiB object gives a real three-part upload.
THRESHOLD = 1 * MiB
PART = 5 * MiB

BAD_DIGESTS = [
    "../../etc/passwd",
    "../" * 21 + "a",
    "A" * 64,
    "a" * 63,
    "a" * 65,
    "sha256:" + "a" * 64,
    "a" * 62 + "/x",
    "g" * 64,
    "",
]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "file":
        return open_blob_store((tmp_path / "blobs").as_uri())
    url = request.getfixturevalue("s3_bucket_url")
    return open_blob_store(url, multipart_threshold=THRESHOLD, multipart_chunksize=PART)


def stored_keys(store: BlobStore) -> list[str]:
    if isinstance(store, LocalBlobStore):
        root = store.root / "sha256"
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert isinstance(store, S3BlobStore)
    resp = store.client.list_objects_v2(Bucket=store.bucket)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def corrupt(store: BlobStore, digest: str, data: bytes) -> None:
    """Overwrite the stored object behind the store's back."""
    if isinstance(store, LocalBlobStore):
        path = store.path_for(digest)
        os.chmod(path, 0o644)
        path.write_bytes(data)
    else:
        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store.key_for(digest), Body=data)


def test_put_bytes_round_trip(store: BlobStore) -> None:
    data = os.urandom(100_000)
    info = store.put_bytes(data)
    assert info == BlobInfo(sha(data), len(data))
    assert store.read_bytes(info.digest) == data
    with store.open(info.digest) as reader:
        assert reader.length == len(data)
        assert b"".join(reader.iter_chunks(4096)) == data


def test_put_file_and_stream_round_trip(store: BlobStore, tmp_path: Path) -> None:
    src = tmp_path / "artifact.bin"
    src.write_bytes(b"compiled" * 1000)
    info = store.put_file(src)
    assert info == BlobInfo(sha(src.read_bytes()), src.stat().st_size)
    dest = tmp_path / "out" / "copy.bin"
    assert store.get_to_file(info.digest, dest) == info.size
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["copy.bin"]

    with open(src, "rb") as f:
        assert store.put_stream(f) == info


def test_empty_blob(store: BlobStore, tmp_path: Path) -> None:
    info = store.put_bytes(b"")
    assert info == BlobInfo(sha(b""), 0)
    assert store.read_bytes(info.digest) == b""
    assert store.get_to_file(info.digest, tmp_path / "empty") == 0
    with pytest.raises(RangeNotSatisfiable):
        store.read_range(info.digest, 0, 0)


def test_put_is_idempotent(store: BlobStore, tmp_path: Path) -> None:
    data = b"same bytes"
    first = store.put_bytes(data)
    assert store.put_bytes(data) == first
    src = tmp_path / "f"
    src.write_bytes(data)
    assert store.put_file(src) == first
    assert len(stored_keys(store)) == 1
    assert store.read_bytes(first.digest) == data


def test_concurrent_puts_of_the_same_bytes(store: BlobStore) -> None:
    data = os.urandom(200_000)
    results: list[BlobInfo] = []
    errors: list[BaseException] = []

    def put() -> None:
        try:
            results.append(store.put_bytes(data))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(results) == {BlobInfo(sha(data), len(data))}
    assert len(stored_keys(store)) == 1
    assert store.read_bytes(sha(data)) == data


def test_exists_and_size(store: BlobStore) -> None:
    data = b"x" * 1234
    digest = sha(data)
    assert not store.exists(digest)
    with pytest.raises(BlobNotFound):
        store.size(digest)
    store.put_bytes(data)
    assert store.exists(digest)
    assert store.size(digest) == 1234


def test_delete(store: BlobStore) -> None:
    info = store.put_bytes(b"to delete")
    store.delete(info.digest)
    assert not store.exists(info.digest)
    store.delete(info.digest)  # absent: not an error
    assert stored_keys(store) == []


def test_get_to_file_rejects_corrupt_blob(store: BlobStore, tmp_path: Path) -> None:
    data = b"genuine artifact bytes"
    info = store.put_bytes(data)
    corrupt(store, info.digest, b"tampered artifact byte")  # same length, other bytes
    dest_dir = tmp_path / "dest"
    dest_dir.mkdir()
    dest = dest_dir / "artifact"
    with pytest.raises(BlobCorrupt) as excinfo:
        store.get_to_file(info.digest, dest)
    assert info.digest in str(excinfo.value)
    assert not dest.exists()
    assert list(dest_dir.iterdir()) == []  # no temp file left behind either


def test_get_to_file_rejects_truncated_blob(store: BlobStore, tmp_path: Path) -> None:
    info = store.put_bytes(b"0123456789")
    corrupt(store, info.digest, b"01234")
    dest = tmp_path / "dest" / "artifact"
    with pytest.raises(BlobCorrupt):
        store.get_to_file(info.digest, dest)
    assert list(dest.parent.iterdir()) == []


def test_get_to_file_keeps_existing_dest_on_corruption(store: BlobStore, tmp_path: Path) -> None:
    info = store.put_bytes(b"genuine")
    corrupt(store, info.digest, b"forged!")
    dest = tmp_path / "artifact"
    dest.write_bytes(b"previous")
    with pytest.raises(BlobCorrupt):
        store.get_to_file(info.digest, dest)
    assert dest.read_bytes() == b"previous"


def test_streaming_read_detects_corruption(store: BlobStore) -> None:
    info = store.put_bytes(b"genuine artifact bytes")
    corrupt(store, info.digest, b"tampered artifact byte")
    with pytest.raises(BlobCorrupt):
        store.read_bytes(info.digest)
    with store.open(info.digest) as reader, pytest.raises(BlobCorrupt):
        list(reader.iter_chunks(5))


def test_missing_digest(store: BlobStore, tmp_path: Path) -> None:
    digest = sha(b"never stored")
    dest = tmp_path / "dest" / "artifact"
    dest.parent.mkdir()
    with pytest.raises(BlobNotFound) as excinfo:
        store.get_to_file(digest, dest)
    assert digest in str(excinfo.value)
    assert list(dest.parent.iterdir()) == []
    with pytest.raises(BlobNotFound):
        store.open(digest)
    with pytest.raises(BlobNotFound):
        store.read_range(digest, 0, 10)
    with pytest.raises(BlobNotFound):
        store.size(digest)
    # A missing blob is also a LookupError, for callers that map it generically.
    with pytest.raises(LookupError):
        store.read_bytes(digest)


@pytest.mark.parametrize("bad", BAD_DIGESTS)
def test_bad_digests_are_rejected(store: BlobStore, tmp_path: Path, bad: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: store.exists(bad),
        lambda: store.size(bad),
        lambda: store.open(bad),
        lambda: store.read_range(bad, 0, 1),
        lambda: store.read_bytes(bad),
        lambda: store.get_to_file(bad, tmp_path / "dest"),
        lambda: store.delete(bad),
        lambda: store.presigned_url(bad),
        lambda: store.local_path(bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="invalid sha256 digest"):
            call()
    assert not (tmp_path / "dest").exists()


def test_non_string_digest_is_rejected(store: BlobStore) -> None:
    with pytest.raises(ValueError):
        store.exists(b"a" * 64)  # type: ignore[arg-type]


def test_range_reads(store: BlobStore) -> None:
    data = bytes(range(256)) * 40
    info = store.put_bytes(data)
    assert store.read_range(info.digest, 0, 9) == data[:10]
    assert store.read_range(info.digest, 100, 199) == data[100:200]
    assert store.read_range(info.digest, 10_000) == data[10_000:]
    # As HTTP: an end past the blob is clipped to its last byte.
    assert store.read_range(info.digest, len(data) - 5, len(data) + 100) == data[-5:]
    with store.open(info.digest, start=5, end=14) as reader:
        assert reader.length == 10
        assert reader.read() == data[5:15]
    for start, end in [(len(data), None), (len(data) + 1, len(data) + 5), (10, 5), (-1, 3)]:
        with pytest.raises(RangeNotSatisfiable):
            store.read_range(info.digest, start, end)


def test_large_object_uses_multipart(store: BlobStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(11 * MiB)
    src.write_bytes(data)
    info = store.put_file(src)
    assert info == BlobInfo(sha(data), len(data))
    dest = tmp_path / "big.copy"
    assert store.get_to_file(info.digest, dest) == len(data)
    assert dest.read_bytes() == data
    assert store.read_range(info.digest, 6 * MiB, 6 * MiB + 99) == data[6 * MiB : 6 * MiB + 100]
    if isinstance(store, S3BlobStore):
        head = store.client.head_object(Bucket=store.bucket, Key=store.key_for(info.digest))
        # A multipart upload's ETag is "<md5 of part md5s>-<number of parts>".
        match = re.fullmatch(r'"[0-9a-f]{32}-(\d+)"', head["ETag"])
        assert match, head["ETag"]
        assert int(match.group(1)) == 3
        assert head["Metadata"]["sha256"] == info.digest
        assert head["ContentLength"] == len(data)


def test_s3_small_object_is_one_put_with_its_sha256(s3_bucket_url: str) -> None:
    store = open_blob_store(s3_bucket_url, multipart_threshold=THRESHOLD)
    assert isinstance(store, S3BlobStore)
    info = store.put_bytes(b"small")
    head = store.client.head_object(
        Bucket=store.bucket, Key=store.key_for(info.digest), ChecksumMode="ENABLED"
    )
    assert re.fullmatch(r'"[0-9a-f]{32}"', head["ETag"])
    assert head["Metadata"]["sha256"] == info.digest
    # A single PUT's SHA256 checksum is the content digest, so S3 checked it on arrival.
    expected = base64.b64encode(bytes.fromhex(info.digest)).decode()
    assert head.get("ChecksumSHA256") == expected


class FailingReader:
    """Yields ``chunks`` then raises, as a producer that dies mid-upload would.

    On every read it records whether the blob it is producing is already
    visible under its digest; it must never be.
    """

    def __init__(self, store: BlobStore, chunks: list[bytes]) -> None:
        self.store = store
        self.chunks = list(chunks)
        self.digest = sha(b"".join(chunks))
        self.seen_visible: list[bool] = []

    def read(self, n: int = -1) -> bytes:
        self.seen_visible.append(self.store.exists(self.digest))
        if self.chunks:
            return self.chunks.pop(0)
        raise OSError("producer died")


def test_interrupted_put_leaves_nothing(store: BlobStore) -> None:
    reader = FailingReader(store, [b"a" * MiB, b"b" * MiB, b"c" * 100])
    with pytest.raises(OSError, match="producer died"):
        store.put_stream(reader)
    assert reader.seen_visible and not any(reader.seen_visible)
    assert not store.exists(reader.digest)
    assert stored_keys(store) == []
    if isinstance(store, LocalBlobStore):
        assert list((store.root / "tmp").iterdir()) == []


def test_local_write_is_never_visible_before_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    data = b"artifact" * 10_000
    digest = sha(data)
    final = store.path_for(digest)
    seen: list[bool] = []
    real_replace = os.replace

    def crash_at_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # Every byte is written and fsynced by now; the key must still be empty.
        seen.append(final.exists())
        assert Path(src).stat().st_size == len(data)
        raise OSError("crashed before rename")

    monkeypatch.setattr(blobstore.os, "replace", crash_at_rename)
    with pytest.raises(OSError, match="crashed before rename"):
        store.put_bytes(data)
    assert seen == [False]
    assert not final.exists()
    assert list((store.root / "tmp").iterdir()) == []

    monkeypatch.setattr(blobstore.os, "replace", real_replace)
    assert store.put_bytes(data) == BlobInfo(digest, len(data))
    assert final.read_bytes() == data


def test_local_layout_and_read_only_mode(tmp_path: Path) -> None:
    store = open_blob_store((tmp_path / "blobs").as_uri())
    assert isinstance(store, LocalBlobStore)
    info = store.put_bytes(b"layout")
    path = tmp_path / "blobs" / "sha256" / info.digest[:2] / info.digest[2:]
    assert store.local_path(info.digest) == path
    assert path.read_bytes() == b"layout"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_local_put_repairs_damaged_copy(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    info = store.put_bytes(b"0123456789")
    corrupt(store, info.digest, b"012")
    store.put_bytes(b"0123456789")
    assert store.read_bytes(info.digest) == b"0123456789"


def test_presigned_url(store: BlobStore) -> None:
    data = os.urandom(50_000)
    info = store.put_bytes(data)
    url = store.presigned_url(info.digest, expires_s=60)
    if isinstance(store, LocalBlobStore):
        assert url is None
        return
    assert url is not None
    resp = httpx.get(url, trust_env=False)
    assert resp.status_code == 200
    assert resp.content == data
    resp = httpx.get(url, headers={"Range": "bytes=10-19"}, trust_env=False)
    assert resp.status_code == 206
    assert resp.content == data[10:20]


def test_store_url_round_trips(store: BlobStore) -> None:
    again = open_blob_store(store.url)
    assert type(again) is type(store)
    assert again.url == store.url
    info = store.put_bytes(b"shared")
    assert again.read_bytes(info.digest) == b"shared"


def test_s3_url_parsing(s3_bucket_url: str) -> None:
    store = open_blob_store(s3_bucket_url)
    assert isinstance(store, S3BlobStore)
    bucket = s3_bucket_url.removeprefix("s3://").split("/")[0]
    digest = "a" * 64
    assert store.key_for(digest) == f"artifacts/sha256/{digest}"
    bare = open_blob_store(f"s3://{bucket}")
    assert isinstance(bare, S3BlobStore)
    assert bare.key_for(digest) == f"sha256/{digest}"


def test_s3_missing_bucket_is_a_clear_error(s3_server: str) -> None:
    store = open_blob_store("s3://no-such-bucket-here/x", endpoint_url=s3_server)
    with pytest.raises(blobstore.BlobStoreError, match="no-such-bucket-here"):
        store.put_bytes(b"x")


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(UnknownBlobScheme) as excinfo:
        open_blob_store("ftp://example.com/blobs")
    message = str(excinfo.value)
    assert "'ftp'" in message
    assert "file://" in message
    assert "s3://" in message
    with pytest.raises(UnknownBlobScheme, match="file://, s3://"):
        open_blob_store("/var/lib/blobs")


def test_file_url_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="file:///ABSOLUTE/PATH"):
        open_blob_store("file://relative/blobs")
