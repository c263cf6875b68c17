"""Artifacts by digest: metadata, and the bytes.

A digest is checked (64 lowercase hex) before anything is built from it, so
no path or key ever holds a client's ``../``. Bytes are content-addressed and
never change under a digest: the digest is the ETag, and a response may be
cached forever. A local store streams the file (Range honoured); S3 hands the
client a presigned URL instead, so the bytes never pass through the API.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from farm.core.digests import InvalidDigest, validate_digest
from registry import service
from registry.blobstore import (
    CHUNK_SIZE,
    BlobCorrupt,
    BlobNotFound,
    BlobReader,
    RangeNotSatisfiable,
)
from registry.entities import ArtifactRecord

from .deps import Reader, State
from .schemas import PROTECTED, err
from .state import AppState

log = logging.getLogger(__name__)

router = APIRouter(tags=["artifacts"])

IMMUTABLE = "public, max-age=31536000, immutable"
# The pattern is documented, not enforced by FastAPI: check_digest answers
# with a message that says what a digest is.
Digest = Annotated[
    str,
    Path(
        description="sha256 of the bytes, 64 lowercase hex",
        json_schema_extra={"pattern": "^[0-9a-f]{64}$"},
    ),
]


class DownloadAborted(RuntimeError):
    """The stored bytes failed their digest while streaming."""


def check_digest(digest: str) -> str:
    return validate_digest(digest)


def _invalid(exc: InvalidDigest) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=422)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for a single ``bytes=`` range, None to send it all.

    Raises ``RangeNotSatisfiable`` (416). A header that does not parse, or asks
    for several ranges, is ignored, as RFC 9110 allows: the client gets the
    whole blob with 200.
    """
    if not header:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, sep, last = spec.strip().partition("-")
    first, last = first.strip(), last.strip()
    if not sep or (first and not first.isdigit()) or (last and not last.isdigit()):
        return None
    if not first:  # suffix: the last N bytes
        if not last:
            return None
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(size, None, size)
        return max(0, size - n), size - 1
    start = int(first)
    end = int(last) if last else None
    if end is not None and end < start:
        return None  # invalid, so ignored
    if start >= size:
        raise RangeNotSatisfiable(start, end, size)
    return start, size - 1 if end is None else min(end, size - 1)


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    for candidate in header.split(","):
        c = candidate.strip()
        if c == "*":
            return True
        c = c.removeprefix("W/")
        if c == etag or c.strip('"') == etag.strip('"'):
            return True
    return False


async def _stream(reader: BlobReader, digest: str) -> AsyncIterator[bytes]:
    # Each chunk goes out only once the next read has come back: the reader
    # checks the digest at its end, so the last chunk is held until the whole
    # blob has checked out, and a corrupt blob never reaches a client whole.
    try:
        pending = b""
        while True:
            chunk = await run_in_threadpool(reader.read, CHUNK_SIZE)
            if not chunk:
                if pending:
                    yield pending
                return
            if pending:
                yield pending
            pending = chunk
    except BlobCorrupt as exc:
        # Headers are gone already: aborting the body (the connection is
        # closed short of Content-Length) is how the client learns. Not a
        # BlobStoreError any more, which would be "handled" after the start.
        log.error("aborted a download: %s", exc)
        raise DownloadAborted(str(exc)) from exc
    finally:
        reader.close()


FILE_CHUNK = 4 * 1024 * 1024
# A verified file is sent straight from its memory map, in slices this big.
MAPPED_CHUNK = 8 * 1024 * 1024
READ_AHEAD = 4 * MAPPED_CHUNK
# Whether a slice is in the page cache is probed one byte every this many.
PROBE_STEP = 512 * 1024
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_probe = bytearray(1)  # used on the event loop thread only


def _in_page_cache(fd: int, start: int, length: int) -> bool:
    """Whether ``start``..``start + length`` looks to be in the page cache: a
    non-blocking one-byte read (RWF_NOWAIT) every PROBE_STEP and at the end
    succeeds. Nothing waits on the disk; anything unusual says no."""
    if _RWF_NOWAIT is None:
        return False
    offsets = [*range(start, start + length, PROBE_STEP), start + length - 1]
    try:
        return all(os.preadv(fd, [_probe], off, _RWF_NOWAIT) == 1 for off in offsets)
    except OSError:  # EAGAIN: on disk only; EOPNOTSUPP: no way to tell
        return False


def _open_local(path: os.PathLike[str] | str, digest: str) -> tuple[BinaryIO, os.stat_result]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the stream
    except FileNotFoundError:
        raise BlobNotFound(digest, "the local blob store") from None
    return f, os.fstat(f.fileno())


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    # ctime cannot be set back by a user: a file rewritten in place, even with
    # its mtime restored, gets a new stamp and is verified again.
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_hashing(f: BinaryIO, n: int, hasher: Any) -> bytes:
    # In a worker thread: neither the read nor the hash holds up the event loop.
    chunk = f.read(n)
    if hasher is not None:
        hasher.update(chunk)
    return chunk


def _map(f: BinaryIO) -> mmap.mmap | None:
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # nothing to map (empty), or a file that cannot be
        return None


async def _stream_file(
    state: AppState, f: BinaryIO, st: os.stat_result, digest: str, *, start: int, length: int
) -> AsyncIterator[bytes | memoryview]:
    """Bytes of a local blob file.

    The first time a worker serves a whole file (and again whenever the file
    changes) it reads it in a worker thread, hashing as it goes, and aborts
    the body if the bytes do not match the digest. Once verified, the file is
    sent from a memory map: the socket write copies straight from the page
    cache, nothing is read into Python, and no thread is involved, which is
    the closest ASGI gets to sendfile. A slice the page cache has lost is read
    in a worker thread instead (with read-ahead), so the event loop never
    waits on the disk. A file cut short while mapped makes the write fail (the
    kernel, not Python, touches the pages) or the read come up short, which
    aborts the body.
    """
    whole = start == 0 and length == st.st_size
    verified = state.verified_files.get(digest) == _stamp(st)
    mapped = _map(f) if verified and length > 0 else None
    try:
        if mapped is not None:
            view = memoryview(mapped)
            fd = f.fileno()
            pos, end = start, start + length
            while pos < end:
                n = min(MAPPED_CHUNK, end - pos)
                if _in_page_cache(fd, pos, n):
                    yield view[pos : pos + n]
                else:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, pos, READ_AHEAD, os.POSIX_FADV_WILLNEED)
                    chunk = await run_in_threadpool(os.pread, fd, n, pos)
                    if len(chunk) < n:
                        raise DownloadAborted(
                            f"blob sha256:{digest} shrank while it was being sent"
                        )
                    yield chunk
                pos += n
            return
        hasher = hashlib.sha256() if whole and not verified else None
        if start:
            f.seek(start)
        left = length
        # While hashing, the last chunk is held back until the digest checks:
        # a corrupt file is then cut short (Content-Length unmet) for every
        # client, also one that does not hash, and a blob of one chunk is
        # never sent at all.
        pending = b""
        while left > 0:
            chunk = await run_in_threadpool(_read_hashing, f, min(FILE_CHUNK, left), hasher)
            if not chunk:
                break
            left -= len(chunk)
            if hasher is None:
                yield chunk
                continue
            if pending:
                yield pending
            pending = chunk
        if left:
            raise DownloadAborted(f"blob sha256:{digest} shrank while it was being sent")
        if hasher is not None:
            actual = hasher.hexdigest()
            if actual != digest:
                # Headers are gone already: aborting the body (the connection
                # is closed short of Content-Length) is how the client learns.
                log.error("aborted a download: blob sha256:%s is corrupt (got %s)", digest, actual)
                raise DownloadAborted(
                    f"blob sha256:{digest} is corrupt in the store: got sha256:{actual}"
                )
            if len(state.verified_files) > 100_000:
                state.verified_files.clear()
            state.verified_files[digest] = _stamp(st)
            if pending:
                yield pending
    finally:
        # The map itself is not closed here: slices of it may still sit in the
        # transport's write buffer. It is unmapped when the last one is dropped.
        f.close()


async def _known(state: AppState, digest: str) -> None:
    """Raise NotFound unless an artifact row has this digest (cached a minute)."""
    hit, _ = state.known_digests.peek(digest)
    if hit:
        return
    await run_in_threadpool(service.get_artifact, state.db, digest)
    state.known_digests.put(digest, True)


@router.get(
    "/v1/artifacts/{digest}/blob",
    responses={
        **PROTECTED,
        200: {"content": {"application/octet-stream": {}}},
        206: {"description": "the requested byte range"},
        304: {"description": "If-None-Match matched: unchanged (it never changes)"},
        307: {"description": "S3: a presigned URL to GET the bytes from"},
        404: err("no such blob"),
        416: err("Range outside the blob"),
        422: err("not a sha256 digest"),
    },
)
async def download(
    digest: Digest,
    state: State,
    _: Reader,
    range_: Annotated[str | None, Header(alias="range")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
    if_range: Annotated[str | None, Header()] = None,
) -> Response:
    """The artifact's bytes (verified against the digest while they stream)."""
    try:
        check_digest(digest)
    except InvalidDigest as exc:
        return _invalid(exc)
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes"}
    if _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    store = state.store
    local = store.local_path(digest)
    if local is None:
        hit, url = state.presigned.peek(digest)
        if not hit:
            # Signing costs about half a millisecond: a fleet fetching one blob
            # shares a URL, re-signed while it still has most of its life.
            url = store.presigned_url(digest)
            if url is not None:
                state.presigned.put(digest, url)
        if url is not None:
            await _known(state, digest)
            return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})
        size = await run_in_threadpool(store.size, digest)
    else:
        f, st = await run_in_threadpool(_open_local, local, digest)
        size = st.st_size
    if if_range is not None and if_range.strip() != etag and if_range.strip() != digest:
        range_ = None  # the client's copy is of something else: send it all
    try:
        span = parse_range(range_, size)
    except RangeNotSatisfiable:
        if local is not None:
            f.close()
        return JSONResponse(
            {"detail": f"range {range_!r} is outside the {size}-byte blob"},
            status_code=416,
            headers={**headers, "Content-Range": f"bytes */{size}"},
        )
    start, end = span if span is not None else (0, size - 1)
    status = 200 if span is None else 206
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    if local is not None:
        return StreamingResponse(
            _stream_file(state, f, st, digest, start=start, length=end - start + 1),
            status_code=status,
            media_type="application/octet-stream",
            headers={**headers, "Content-Length": str(end - start + 1)},
        )
    # Another store that cannot presign: stream through its reader (which
    # verifies a whole blob as it goes).
    reader = await run_in_threadpool(
        lambda: store.open(digest) if span is None else store.open(digest, start=start, end=end)
    )
    return StreamingResponse(
        _stream(reader, digest),
        status_code=status,
        media_type="application/octet-stream",
        headers={**headers, "Content-Length": str(end - start + 1)},
    )


def attestation_of(record: ArtifactRecord) -> dict[str, Any]:
    """The build statement as it was stored (the names it serves are a resolve's answer)."""
    build = None
    if record.attestation:
        try:
            build = json.loads(record.attestation)
        except ValueError:
            log.warning("artifact %s: stored attestation is not JSON", record.id)
    return {"build": build, "version": None, "alias": None}


@router.get(
    "/v1/artifacts/{digest}",
    responses={**PROTECTED, 404: err("no such artifact"), 422: err("not a sha256 digest")},
)
async def artifact(digest: Digest, request: Request, state: State, _: Reader) -> Response:
    """An artifact's metadata, build attestation and download URL."""
    try:
        check_digest(digest)
    except InvalidDigest as exc:
        return _invalid(exc)
    record = await run_in_threadpool(service.get_artifact, state.db, digest)
    out: dict[str, Any] = {
        **record.to_json(),
        # The build statement only: which names it serves is the resolve's answer.
        "attestation": attestation_of(record),
        "download_url": f"{request.base_url}v1/artifacts/{digest}/blob",
    }
    return JSONResponse(out)


@router.get("/v1/artifacts/{rest:path}", include_in_schema=False)
async def bad_artifact_path(rest: str) -> Response:
    # Reached by digests with path characters ('../x', 'a/b'), once decoded.
    try:
        validate_digest(rest)
    except InvalidDigest as exc:
        return _invalid(exc)
    raise AssertionError("a valid digest cannot contain a path separator")
