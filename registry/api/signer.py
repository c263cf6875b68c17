"""The farm's signing key as the API holds it: loaded once, used on the resolve path.

What is signed for an artifact is its digest and ``signed_metadata``: the
fields that decide what the bytes are for. A node verifies the signature over
the same fields of the artifact JSON the resolve call returned (the field list
travels with it as ``signed_fields``) before it unpickles anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from farm.core.settings import Settings
from farm.core.signing import (
    key_id,
    load_or_create_signing_key,
    load_private_key,
    public_key_pem,
    sign_artifact,
)
from registry.entities import ArtifactRecord

log = logging.getLogger(__name__)

# Keys of ArtifactRecord.to_json() that the signature covers, besides the digest.
SIGNED_FIELDS: tuple[str, ...] = (
    "format", "build_key", "fingerprint", "inputs", "grad_mode", "options", "target", "size",
)
DEFAULT_KEY_FILE = "signing-key.pem"


def signed_metadata(artifact_json: dict[str, Any]) -> dict[str, Any]:
    """The metadata signed for an artifact, from its JSON form (``ArtifactRecord.to_json``)."""
    return {k: artifact_json[k] for k in SIGNED_FIELDS}


def default_key_path(settings: Settings) -> Path:
    return settings.farm_home / DEFAULT_KEY_FILE


class Signer:
    def __init__(self, settings: Settings) -> None:
        source = settings.farm_signing_key.strip()
        if source and ("-----BEGIN" in source or Path(source).exists()):
            self._key = load_private_key(source)
            where = "FARM_SIGNING_KEY"
        else:
            # Embedded mode, or a configured path that does not exist yet:
            # create the key there (0600). Several API replicas must share one
            # key, so outside SQLite say loudly that it was made up here.
            path = Path(source) if source else default_key_path(settings)
            self._key = load_or_create_signing_key(path)
            where = str(path)
            if settings.database_url and not settings.database_url.startswith("sqlite"):
                log.warning("FARM_SIGNING_KEY is not set: signing with %s; every API replica "
                            "must use the same key, so configure it explicitly", path)
        self.key_id = key_id(self._key)
        self.public_pem = public_key_pem(self._key)
        log.info("signing artifacts with key %s (%s)", self.key_id, where)

    def sign(self, record: ArtifactRecord) -> str:
        return sign_artifact(self._key, record.digest, signed_metadata(record.to_json()))
