"""Code packs: the user's model code, uploaded by ``farm submit`` before the job.

Content-addressed like artifacts: ``PUT /v1/code/{digest}`` stores the body
under its sha256, which must be ``digest``; ``HEAD`` says whether the farm
has a pack already, so a client uploads each version of its code once. The
API checks that the body is a code pack (``farm.core.codepack``: an
uncompressed tar of plain files and directories with relative names) and
never imports, unpacks or runs it: that happens in the build sandbox.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from farm.core.codepack import CodePackError, check_pack_bytes
from farm.core.digests import is_digest

from .deps import Reader, State, Submitter
from .schemas import PROTECTED, err

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/code", tags=["code"], responses=PROTECTED)

DigestPath = Annotated[str, Path(min_length=64, max_length=64,
                                 description="sha256 hex of the code pack's bytes")]


class CodeOut(BaseModel):
    digest: str
    size: int
    files: int
    stored: bool  # false: the farm had this pack already


def _check(digest: str) -> str:
    if not is_digest(digest):
        raise HTTPException(422, f"invalid code digest {digest[:80]!r}: expected 64 lowercase "
                                 "hex characters (the sha256 of the pack)")
    return digest


@router.head("/{digest}", responses={404: err("the farm has no such code pack")})
def has_code(digest: DigestPath, state: State, _: Reader) -> Response:
    """200 when the farm has this code pack, 404 when it must be uploaded."""
    _check(digest)
    if not state.store.exists(digest):
        return Response(status_code=404)
    return Response(status_code=200)


@router.put("/{digest}", response_model=CodeOut, status_code=201,
            responses={200: {"description": "the farm had this pack already"},
                       413: err("body over CODE_PACK_MAX_BYTES"),
                       422: err("the body does not hash to the digest, or is not a code pack")})
async def put_code(digest: DigestPath, request: Request, state: State, who: Submitter,
                   response: Response) -> CodeOut:
    """Store a code pack (the body: an uncompressed tar) under its sha256."""
    _check(digest)
    limit = state.settings.code_pack_max_bytes
    # BodyLimit (CODE_PACK_MAX_BYTES on this path) stops a larger body while it streams.
    data = await request.body()
    if len(data) > limit:
        raise HTTPException(413, f"code pack is {len(data)} bytes, over the {limit} byte limit "
                                 "(CODE_PACK_MAX_BYTES)")
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise HTTPException(422, f"the body hashes to {actual}, not to {digest}: the upload was "
                                 "cut or changed on the way; upload it again")
    try:
        files = check_pack_bytes(data, max_bytes=limit)
    except CodePackError as exc:
        raise HTTPException(422, f"not a code pack: {exc}") from None
    if await run_in_threadpool(state.store.exists, digest):
        response.status_code = 200
        return CodeOut(digest=digest, size=len(data), files=len(files), stored=False)
    info = await run_in_threadpool(state.store.put_bytes, data)
    log.info("code pack %s stored (%d bytes, %d files) for %s", digest[:12], info.size,
             len(files), who.name)
    return CodeOut(digest=digest, size=info.size, files=len(files), stored=True)
