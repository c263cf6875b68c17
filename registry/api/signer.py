"""The API's name key: it binds model names, versions and aliases, and nothing else.

A version statement ("model@version is this program") is signed when the
authenticated submission that creates the version is accepted; an alias
statement ("model@alias points at this version") when the alias change is.
Both are stored as signed and served as stored: the API never signs
anything later from what the database holds, so a row written straight into
PostgreSQL carries no valid binding.

The key is a file the API process reads (``FARM_NAME_KEY``, a path): not in
the database, not given to workers. It cannot sign builds: nodes accept
build statements only from keys the root-signed trust list gives the
``builder`` role, and name statements only from the key it gives ``names``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from farm.core import attest
from farm.core.keys import load_or_create_signing_key, load_private_key, public_key_pem
from farm.core.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_KEY_FILE = "name-key.pem"


def default_key_path(settings: Settings) -> Path:
    return settings.farm_home / DEFAULT_KEY_FILE


class NameKeyError(ValueError):
    pass


class NameSigner:
    def __init__(self, settings: Settings) -> None:
        source = settings.farm_name_key.strip()
        if "-----BEGIN" in source:
            raise NameKeyError("FARM_NAME_KEY holds PEM text; give a path to a 0600 file "
                               "(an environment is readable by other processes of the user)")
        if source and Path(source).exists():
            self._key = load_private_key(source)
            where = source
        else:
            # Embedded mode, or a configured path that does not exist yet:
            # create the key there (0600). Nodes refuse its statements until
            # an admin enrols it (farm keys enroll --role names) and signs a
            # trust list; say so outside the embedded default.
            path = Path(source) if source else default_key_path(settings)
            self._key = load_or_create_signing_key(path)
            where = str(path)
            if settings.database_url and not settings.database_url.startswith("sqlite"):
                log.warning("FARM_NAME_KEY is not set or missing: made a name key at %s; nodes "
                            "refuse its statements until it is enrolled (farm keys enroll "
                            "--role names) and on a root-signed trust list; every API replica "
                            "must use the same key", path)
        self.keyid = attest.keyid(self._key)
        self.public_pem = public_key_pem(self._key)
        self._own = {self.keyid: self._key.public_key()}
        log.info("signing names with key %s (%s)", self.keyid[:16], where)

    def sign_version(self, *, model: str, version: str, program: dict[str, Any],
                     submitted_by: str | None, project: str | None = None) -> str:
        stmt = attest.version_statement(model=model, version=version, program=program,
                                        issued_at=attest.now_iso(), submitted_by=submitted_by,
                                        project=project)
        return _text(attest.sign_statement(self._key, stmt))

    def sign_alias(self, *, model: str, alias: str, version: str, program: dict[str, Any],
                   set_by: str | None, project: str | None = None) -> str:
        stmt = attest.alias_statement(model=model, alias=alias, version=version, program=program,
                                      issued_at=attest.now_iso(), set_by=set_by, project=project)
        return _text(attest.sign_statement(self._key, stmt))

    def read_own(self, envelope: str, predicate_type: str) -> attest.Statement:
        """A statement this key signed (a stored version binding, read back
        when an alias is pointed at it); ``AttestationError`` otherwise."""
        _, payload = attest.verify_envelope(envelope, self._own,
                                            payload_type=attest.IN_TOTO_PAYLOAD_TYPE)
        return attest.parse_statement(payload, predicate_type=predicate_type, keyid_=self.keyid)


def _text(envelope: dict[str, Any]) -> str:
    return json.dumps(envelope, sort_keys=True, separators=(",", ":"))
