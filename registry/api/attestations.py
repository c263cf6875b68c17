"""Build statements by digest: ``GET /v1/attestations/<sha256 of the statement>``.

A resolve answer names its artifact's build statement by digest instead of
carrying it (it holds the weights manifest and the verification report,
which grow with the model). The bytes at a digest never change, so the
answer says so (a year's ``max-age``, ``immutable``, the digest as its
ETag; ``If-None-Match`` gets a 304), and a node keeps each one it fetched by
digest. Nothing here is trusted by the node beyond the digest: it checks the
sha256 of what it got, then the statement's signature and every field
against its own request (``farm.node.verify``).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Annotated

import cachetools
from fastapi import APIRouter, Header, Path
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from farm.core.digests import InvalidDigest, validate_digest
from registry import models as m
from registry.db import Database

from .artifacts import IMMUTABLE
from .deps import Reader, State
from .resolve_answer import ATTESTATIONS_PATH
from .schemas import PROTECTED, err

router = APIRouter(tags=["artifacts"])

# Statements served lately, by digest: a fleet restarting asks for the same
# few at once. Bounded in bytes (a large model's statement is ~100 KB).
_CACHE_BYTES = 64 << 20


_served: cachetools.LRUCache[str, bytes] = cachetools.LRUCache(
    maxsize=_CACHE_BYTES, getsizeof=len
)
# statement_bytes runs in the thread pool, and an LRU reorders itself on reads.
_served_lock = threading.Lock()


def statement_bytes(db: Database, digest: str) -> bytes | None:
    """The stored statement whose sha256 is ``digest`` (None: no such one)."""
    with _served_lock:
        hit = _served.get(digest)
    if hit is not None:
        return hit
    with db.session() as s:
        text = s.scalar(
            select(m.Artifact.attestation).where(m.Artifact.attestation_sha256 == digest).limit(1)
        )
    if text is None:
        return None
    data = text.encode()
    # The index names it; the bytes must still hash to it (a row changed by
    # hand without its digest must not be served under the old name).
    if hashlib.sha256(data).hexdigest() != digest:
        return None
    if len(data) <= _CACHE_BYTES // 16:
        with _served_lock:
            _served[digest] = data
    return data


@router.get(
    ATTESTATIONS_PATH + "{digest}",
    responses={
        **PROTECTED,
        200: {"description": "the build statement (a DSSE envelope)"},
        304: {"description": "the ETag sent in If-None-Match: unchanged (it never changes)"},
        404: err("no build statement has this digest"),
        422: err("not a sha256 digest"),
    },
)
async def attestation(
    digest: Annotated[
        str,
        Path(
            description="sha256 of the statement's bytes, 64 lowercase hex",
            json_schema_extra={"pattern": "^[0-9a-f]{64}$"},
        ),
    ],
    state: State,
    _: Reader,
    if_none_match: Annotated[str | None, Header(max_length=256)] = None,
) -> Response:
    """A build statement, by the sha256 its resolve answers name it by."""
    try:
        validate_digest(digest)
    except InvalidDigest as exc:
        return JSONResponse({"detail": str(exc)}, status_code=422)
    etag = f'"{digest}"'
    headers = {"Cache-Control": IMMUTABLE, "ETag": etag}
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers=headers)
    data = await run_in_threadpool(statement_bytes, state.db, digest)
    if data is None:
        return JSONResponse(
            {
                "detail": f"no build statement has digest {digest}: resolve "
                "again for the artifact's current one"
            },
            status_code=404,
        )
    return Response(data, media_type="application/json", headers=headers)
