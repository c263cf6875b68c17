"""The fleet node's content-addressed cache: atomic, verified, shared, bounded."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.node.cache import ArtifactCache, CacheCorrupt, InvalidDigest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunks(data: bytes, size: int = 7) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def visible_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blobs").iterdir())


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    return ArtifactCache(tmp_path / "cache", max_bytes=10_000)


def test_put_then_get(cache: ArtifactCache) -> None:
    data = b"artifact bytes" * 100
    d = sha(data)
    assert cache.get(d) is None
    path = cache.put_stream(d, chunks(data))
    assert path == cache.path_for(d)
    assert path.read_bytes() == data
    assert cache.get(d) == path
    assert cache.get(d, size=len(data)) == path
    assert d in cache
    # Only the blob itself: no temp file left behind.
    assert visible_files(cache.root) == [path]


def test_put_is_atomic_no_partial_file_visible(cache: ArtifactCache) -> None:
    data = os.urandom(5000)
    d = sha(data)
    seen: list[bool] = []

    def watching() -> Iterator[bytes]:
        for c in chunks(data, 1000):
            # While writing, the final name never exists.
            seen.append(cache.path_for(d).exists())
            yield c

    cache.put_stream(d, watching())
    assert seen and not any(seen)
    assert cache.path_for(d).read_bytes() == data


def test_corrupt_stream_refused_and_nothing_left(cache: ArtifactCache) -> None:
    data = b"good bytes"
    d = sha(data)
    with pytest.raises(CacheCorrupt):
        cache.put_stream(d, chunks(b"evil bytes"))
    assert cache.get(d) is None
    assert visible_files(cache.root) == []


def test_stream_longer_than_size_is_cut_off(cache: ArtifactCache) -> None:
    data = b"x" * 100
    pulled = 0

    def endless() -> Iterator[bytes]:
        nonlocal pulled
        while True:
            pulled += 1
            yield b"x" * 10

    with pytest.raises(CacheCorrupt, match="more than"):
        cache.put_stream(sha(data), endless(), size=50)
    assert pulled < 10
    assert visible_files(cache.root) == []


def test_error_in_stream_leaves_nothing(cache: ArtifactCache) -> None:
    def broken() -> Iterator[bytes]:
        yield b"half"
        raise ConnectionError("reset")

    with pytest.raises(ConnectionError):
        cache.put_stream(sha(b"halfandmore"), broken())
    assert visible_files(cache.root) == []


def test_existing_blob_is_not_downloaded_again(cache: ArtifactCache) -> None:
    data = b"once"
    d = sha(data)
    cache.put_stream(d, chunks(data))
    started = False

    def download() -> Iterator[bytes]:
        nonlocal started
        started = True
        yield data

    cache.put_stream(d, download())
    assert not started


@pytest.mark.parametrize(
    "digest", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61, "a" * 63 + "/", None, 7]
)
def test_bad_digest_refused(cache: ArtifactCache, digest: object) -> None:
    with pytest.raises(InvalidDigest):
        cache.path_for(digest)  # type: ignore[arg-type]
    with pytest.raises(InvalidDigest):
        cache.put_stream(digest, [b"x"])  # type: ignore[arg-type]
    with pytest.raises(InvalidDigest):
        cache.get(digest)  # type: ignore[arg-type]
    assert digest not in cache


def test_tampered_blob_is_dropped_on_first_use(tmp_path: Path) -> None:
    root = tmp_path / "c"
    data = b"payload" * 10
    d = sha(data)
    ArtifactCache(root, 10_000).put_stream(d, [data])
    (root / "blobs" / d).write_bytes(b"tampered" * 10)
    fresh = ArtifactCache(root, 10_000)  # a new process: nothing verified yet
    assert fresh.get(d) is None
    assert not (root / "blobs" / d).exists()


def test_wrong_size_is_dropped(cache: ArtifactCache) -> None:
    data = b"sized"
    d = sha(data)
    cache.put_stream(d, [data])
    assert cache.get(d, size=len(data) + 1) is None
    assert d not in cache


def _age(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_eviction_keeps_under_max_bytes_lru(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "c", max_bytes=2500)
    blobs = [bytes([i]) * 1000 for i in range(3)]
    digests = [sha(b) for b in blobs]
    cache.put_stream(digests[0], [blobs[0]])
    _age(cache.path_for(digests[0]), 300)
    cache.put_stream(digests[1], [blobs[1]])
    _age(cache.path_for(digests[1]), 200)
    # Using blob 0 makes it recent: blob 1 is now the least recently used.
    assert cache.get(digests[0]) is not None
    cache.put_stream(digests[2], [blobs[2]])
    assert cache.total_bytes() <= 2500
    assert digests[1] not in cache
    assert digests[0] in cache and digests[2] in cache


def test_eviction_never_removes_the_blob_just_written(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "c", max_bytes=100)
    big = b"z" * 500
    path = cache.put_stream(sha(big), [big])
    assert path.exists()
    small = b"s" * 10
    cache.put_stream(sha(small), [small])
    assert sha(small) in cache and sha(big) not in cache


def test_eviction_skips_held_blobs(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "c", max_bytes=1500)
    a, b = b"a" * 1000, b"b" * 1000
    cache.put_stream(sha(a), [a])
    _age(cache.path_for(sha(a)), 100)
    with cache.hold(sha(a)) as held:
        assert held is not None
        # Held (shared lock) by a reader: cannot be evicted, even though LRU.
        _age(held, 100)
        cache.put_stream(sha(b), [b])
        assert held.exists()
    # Released: the next eviction pass may take it.
    assert cache.evict() == [sha(a)]
    assert cache.total_bytes() <= 1500


def test_stale_temp_files_are_swept(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "c", max_bytes=1000)
    d = sha(b"never finished")
    tmp = cache.root / "blobs" / f".{d}.abcdef.tmp"
    tmp.write_bytes(b"partial")
    _age(tmp, 10 * 3600)
    cache.evict()
    assert not tmp.exists()


# --- several processes --------------------------------------------------------------


def _put_from_process(root: str, digest: str, data: bytes, barrier: object,
                      log_dir: str) -> None:
    cache = ArtifactCache(root, max_bytes=10**9)
    barrier.wait()  # type: ignore[attr-defined]

    def download() -> Iterator[bytes]:
        # Record that this process really downloaded, then stream slowly so
        # the other process arrives while the lock is held.
        Path(log_dir, f"download-{os.getpid()}").touch()
        for c in chunks(data, 4096):
            time.sleep(0.002)
            yield c

    path = cache.put_stream(digest, download())
    assert path.read_bytes() == data


def test_two_processes_putting_one_digest_end_with_one_good_file(tmp_path: Path) -> None:
    data = os.urandom(200_000)
    d = sha(data)
    root = tmp_path / "shared"
    ArtifactCache(root, max_bytes=10**9)
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_put_from_process,
                         args=(str(root), d, data, barrier, str(log_dir))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert visible_files(root) == [root / "blobs" / d]
    assert (root / "blobs" / d).read_bytes() == data
    # The second process waited on the lock and found the blob: one download.
    assert len(list(log_dir.iterdir())) == 1
