"""The node cache's verified markers: a blob hashed once (by ``farm prefetch``)
is not hashed again by every later process, and any change to the file makes
the next use hash it again (and refuse it when its bytes are no longer the
digest's)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

import farm.node.cache as cache_mod
from farm.node import verify
from farm.node.cache import ArtifactCache


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the cache and check_file hash, in order."""
    seen: list[Path] = []
    real = cache_mod.sha256_file

    def counting(path: Any) -> str:
        seen.append(Path(path))
        return str(real(path))

    monkeypatch.setattr(cache_mod, "sha256_file", counting)
    monkeypatch.setattr(verify, "sha256_file", counting)
    # Each test starts as a fresh process would: nothing hashed in memory.
    monkeypatch.setattr(cache_mod, "_HASHED", {})
    return seen


def put(root: Path, data: bytes) -> tuple[ArtifactCache, str]:
    c = ArtifactCache(root, max_bytes=1 << 20)
    d = sha(data)
    c.put_stream(d, iter([data]))
    return c, d


def fresh_process(root: Path) -> ArtifactCache:
    """A cache object of a later process: its in-memory sets are empty."""
    cache_mod._HASHED.clear()
    return ArtifactCache(root, max_bytes=1 << 20)


def test_a_later_process_takes_the_marker_and_does_not_hash(
    tmp_path: Path, hashes: list[Path]
) -> None:
    _, d = put(tmp_path, b"artifact" * 1000)
    assert (tmp_path / "verified" / d).is_file()
    later = fresh_process(tmp_path)
    assert later.get(d) is not None
    assert hashes == []


def test_a_file_rewritten_in_place_is_hashed_again_and_dropped(
    tmp_path: Path, hashes: list[Path]
) -> None:
    data = b"artifact" * 1000
    _, d = put(tmp_path, data)
    blob = tmp_path / "blobs" / d
    st = blob.stat()
    # Same size, other bytes, and the mtime put back: only the ctime tells.
    blob.write_bytes(b"X" * len(data))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    later = fresh_process(tmp_path)
    assert later.get(d) is None
    assert hashes == [blob]
    assert not blob.exists()
    assert not (tmp_path / "verified" / d).exists()


def test_a_marker_that_does_not_match_the_file_is_not_believed(
    tmp_path: Path, hashes: list[Path]
) -> None:
    _, d = put(tmp_path, b"artifact" * 1000)
    (tmp_path / "verified" / d).write_text("1 2 8000 3")
    later = fresh_process(tmp_path)
    assert later.get(d) is not None
    assert hashes == [tmp_path / "blobs" / d]
    # ...and the marker is right again for the next process.
    hashes.clear()
    assert fresh_process(tmp_path).get(d) is not None
    assert hashes == []


def test_a_marker_survives_the_lru_touch_of_get(tmp_path: Path, hashes: list[Path]) -> None:
    _, d = put(tmp_path, b"artifact" * 1000)
    for _ in range(3):
        assert fresh_process(tmp_path).get(d) is not None
    assert hashes == []


def test_eviction_removes_the_marker(tmp_path: Path, hashes: list[Path]) -> None:
    c = ArtifactCache(tmp_path, max_bytes=10_000)
    first, second = b"a" * 6000, b"b" * 6000
    c.put_stream(sha(first), iter([first]))
    c.put_stream(sha(second), iter([second]))
    assert not (tmp_path / "blobs" / sha(first)).exists()
    assert not (tmp_path / "verified" / sha(first)).exists()
    assert (tmp_path / "verified" / sha(second)).exists()


def attested(digest: str, size: int) -> verify.Verified:
    return cast(verify.Verified, SimpleNamespace(digest=digest, size=size))


def test_check_file_does_not_hash_what_the_cache_just_checked(
    tmp_path: Path, hashes: list[Path]
) -> None:
    data = b"artifact" * 1000
    _, d = put(tmp_path, data)
    later = fresh_process(tmp_path)
    path = later.get(d)
    assert path is not None
    verify.check_file(path, attested(d, len(data)))
    assert hashes == []


def test_check_file_hashes_a_file_changed_since_and_refuses_it(
    tmp_path: Path, hashes: list[Path]
) -> None:
    data = b"artifact" * 1000
    c, d = put(tmp_path, data)
    path = c.get(d)
    assert path is not None
    path.write_bytes(b"X" * len(data))
    with pytest.raises(verify.AttestationRefused, match="hashes to"):
        verify.check_file(path, attested(d, len(data)))
    assert hashes == [path]


def test_check_file_of_a_file_no_cache_checked_hashes_it(
    tmp_path: Path, hashes: list[Path]
) -> None:
    data = b"artifact" * 10
    f = tmp_path / "model.pt2"
    f.write_bytes(data)
    verify.check_file(f, attested(sha(data), len(data)))
    assert hashes == [f]
    with pytest.raises(verify.AttestationRefused, match="hashes to"):
        verify.check_file(f, attested(sha(b"other"), len(data)))
