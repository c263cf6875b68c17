"""Signing keys and the trust list.

An admin enrols builder keys and the API's name key here (``farm keys
enroll``), revokes them, and uploads the trust list they signed offline with
the root key (``farm keys sign-trust-list``). The API only stores and serves
it: nodes verify it with the root key they pin, so neither this API nor its
database can add a key that nodes would trust.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from farm.core import attest
from farm.core.keys import SigningKeyError, load_public_key, public_key_pem
from registry import service
from registry.service import trust

from .deps import Admin, Reader, State
from .schemas import PROTECTED, err

router = APIRouter(tags=["keys"], responses=PROTECTED)


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="e.g. the worker pool's name")
    role: Literal["builder", "names"] = Field(
        description="builder: a compile worker's key (signs builds); names: the API's name key")
    public_key: str = Field(max_length=4096, description="the public key, PEM")

    @field_validator("public_key")
    @classmethod
    def _pem_text(cls, pem: str) -> str:
        # Only PEM text: the key loader also reads a path, and the API must
        # never read a file a request names.
        if "-----BEGIN" not in pem:
            raise ValueError("public_key must be PEM text ('-----BEGIN PUBLIC KEY-----' ...)")
        return pem

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        # The name goes into the signed trust list and the database (PostgreSQL
        # refuses NUL in text): control characters would be a 500 or a list
        # nobody can read.
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: no text column can store them
            raise ValueError("a key's name must be valid UTF-8 text") from None
        if not name.strip() or any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError("a key's name must be printable and not only whitespace")
        return name


class RevokeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=512)


@router.get("/v1/keys")
def list_keys(state: State, _: Reader) -> dict[str, Any]:
    """Enrolled keys (what the next trust list should hold) and this API's name key."""
    return {
        "keys": [k.to_json() for k in trust.list_keys(state.db)],
        "name_key": {"keyid": state.signer.keyid, "public_key": state.signer.public_pem},
    }


@router.post("/v1/keys", status_code=201, responses={422: err("not an Ed25519 public key")})
def enroll_key(body: KeyIn, state: State, who: Admin) -> dict[str, Any]:
    """Enrol a public key; nodes trust it once a root-signed trust list lists it."""
    rec = trust.enroll_key(state.db, name=body.name.strip(), role=body.role,
                           public_key=body.public_key, enrolled_by=who.name)
    return rec.to_json()


@router.post("/v1/keys/{keyid}/revoke",
             responses={404: err("no such key"), 422: err("ambiguous key id prefix")})
def revoke_key(keyid: Annotated[str, Path(min_length=8, max_length=64)], body: RevokeIn,
               state: State, who: Admin) -> dict[str, Any]:
    """Mark a key revoked; nodes refuse it once the next signed trust list says so."""
    rec = trust.revoke_key(state.db, keyid.lower(), reason=body.reason or f"revoked by {who.name}")
    return rec.to_json()


@router.get("/v1/trust-list", responses={404: err("no trust list uploaded yet")})
def get_trust_list(state: State) -> Response:
    """The newest trust list (a DSSE envelope signed by the root key). Public:
    it is worth nothing without the root signature a node checks."""
    latest = trust.latest_trust_list(state.db)
    if latest is None:
        raise service.NotFound("no trust list yet: an admin signs one with "
                               "`farm keys sign-trust-list --root-key ROOT.pem`")
    return JSONResponse(json.loads(latest[1]), headers={"X-Trust-List-Version": str(latest[0])})


@router.put("/v1/trust-list", responses={422: err("not signed by the root key, or not newer")})
def put_trust_list(envelope: dict[str, Any], state: State, who: Admin) -> dict[str, Any]:
    """Store a trust list signed offline. Checked against ``FARM_ROOT_KEY`` when
    the API has it; nodes check it in any case."""
    root = state.settings.farm_root_key.strip()
    try:
        if root:
            tl = attest.verify_trust_list(envelope, root)
            version, root_id = tl.version, tl.root_keyid
        else:
            _, payload, sigs = attest.parse_envelope(envelope)
            body = attest.payload_json(payload)
            version, root_id = int(body.get("version") or 0), sigs[0][0]
    except (attest.AttestationError, SigningKeyError, ValueError) as exc:
        raise service.InvalidRequest(f"trust list refused: {exc}") from None
    trust.store_trust_list(state.db, envelope, root_keyid=root_id, version=version,
                           uploaded_by=who.name)
    return {"version": version, "root_keyid": root_id}


@router.get("/v1/root-key", response_class=PlainTextResponse,
            responses={200: {"content": {"application/x-pem-file": {}}},
                       404: err("the API was not given the root key")})
def root_key(state: State) -> Response:
    """The root public key (PEM), for a loopback embedded farm's node to trust
    on first use. Anywhere else nodes configure FARM_ROOT_KEY: whoever can
    forge this answer could hand out their own root."""
    root = state.settings.farm_root_key.strip()
    if not root:
        raise service.NotFound("the API has no FARM_ROOT_KEY; configure the root key on "
                               "nodes (FARM_ROOT_KEY)")
    try:
        key = load_public_key(root)
    except SigningKeyError as exc:
        raise service.InvalidRequest(f"FARM_ROOT_KEY: {exc}") from None
    return PlainTextResponse(public_key_pem(key), media_type="application/x-pem-file",
                             headers={"X-Key-Id": attest.keyid(key)})
