"""What a compile worker signs when an artifact passes verification.

The build statement (an in-toto Statement v1 in a DSSE envelope, see
``farm.core.attest``) binds the artifact's digest, size and format to what it
was built from and by whom: build key and fingerprint; the program (code
digest, entrypoint, kwargs, kind); inputs, grad mode, options and target; the
builder's identity and key; the toolchain (python, torch, triton, the C++
compiler Inductor ran); and the build time.

The builder key is the worker's own (one per worker or per pool), named by
``FARM_BUILDER_KEY`` (a path to a PEM file, mode 0600). It is read by the
worker process, never by the sandboxed children that run model code: those
run as another user or in other namespaces (``farm.build.sandbox``), and the
key is never put in an environment variable, since any process of the same
user can read another's ``/proc/<pid>/environ``. An admin enrols the public
half (``farm keys enroll``) and signs it into the trust list; nodes accept
build statements from enrolled, unrevoked builder keys only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import os
import platform
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core import attest
from farm.core.inputs import format_inputs
from farm.core.keys import SigningKeyError, load_or_create_signing_key, load_private_key
from farm.core.specs import JobSpec
from farm.core.target import Target

log = logging.getLogger(__name__)

BUILDER_KEY_ENV = "FARM_BUILDER_KEY"
DEFAULT_KEY_FILE = "builder-key.pem"
# The statement's "verification" block: who compared the artifact with eager,
# and what a pass is worth.
VERIFIED_BY = "submitter-code sandbox"
VERIFIED_MEANS = ("the submitter's own code ran the comparison with eager in the build "
                  "sandbox: it catches honest mistakes, not a hostile submitter")


class BuilderKeyMissing(SigningKeyError):
    """The worker has no builder key, so nothing it builds could be loaded."""


def subject_name(digest: str, fmt: str) -> str:
    return f"sha256:{digest}.{fmt}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, Any]:
    """python, torch and triton of this worker (the C++ compiler comes per
    artifact: the one Inductor ran is recorded in its metadata)."""
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton") or _version("pytorch-triton"),
    }


def program_of_spec(spec: JobSpec) -> dict[str, Any]:
    return attest.program_of_spec(spec)


def _json_safe(value: Any) -> Any:
    """Canonical JSON has no NaN or infinity (a verifier's error can be NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def build_statement(
    *,
    digest: str,
    size: int,
    fmt: str,
    build_key: str,
    fingerprint: str,
    spec: JobSpec,
    target: Target,
    builder_id: str,
    builder_keyid: str,
    built_at: str,
    meta: Mapping[str, Any] | None = None,
    verification: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    meta = dict(meta or {})
    toolchain = dict(toolchain_versions())
    # The C++ compiler the compile step ran and what its library needs of
    # libstdc++ (farm.build.compile records them per artifact), when present.
    for key in ("cxx", "libstdcxx_needs", "cpu_isa", "march"):
        if meta.get(key) is not None:
            toolchain[key] = _json_safe(meta[key])
    return attest.statement(subject_name(digest, fmt), digest, attest.BUILD_PREDICATE, {
        "artifact": {"digest": digest, "size": int(size), "format": fmt},
        "build_key": build_key,
        "fingerprint": fingerprint,
        "program": program_of_spec(spec),
        "inputs": format_inputs(spec.inputs),
        "grad_mode": spec.grad_mode.value,
        "options": spec.options.to_json(),
        "target": str(target),
        # The model's project (absent: default): part of the build key, so a
        # node recomputes the key with it.
        **({"project": spec.project} if spec.project else {}),
        "builder": {"id": builder_id, "keyid": builder_keyid},
        "toolchain": toolchain,
        "built_at": built_at,
        # Who ran the comparison, said where a reader of the statement sees it:
        # the verifier child runs the submitter's own code (its factory and
        # forward), so a pass catches an honest mistake, not a hostile
        # submitter, who can make its own verifier report anything
        # (docs/security.md, "Children are hostile").
        "verification": {**_json_safe(dict(verification or {})),
                         "performed_by": VERIFIED_BY, "meaning": VERIFIED_MEANS},
        # Signed, so a node's class check (farm.node.compiled.class_mismatch)
        # compares its module with what the builder recorded, not with the
        # artifact row's unsigned meta.
        **({"model_class": str(meta["model_class"])} if meta.get("model_class") else {}),
        # Signed with the rest: a node checks its module's weights against it
        # (farm.node.weight_check), and a fake-weight build has no guards on
        # them, so a manifest changed in transit must not pass.
        **({"weights_manifest": _json_safe(meta["weights_manifest"])}
           if meta.get("weights_manifest") else {}),
    })


class BuildSigner:
    """A compile worker's builder key and identity."""

    def __init__(self, key: Ed25519PrivateKey, *, builder_id: str | None = None) -> None:
        self._key = key
        self.keyid = attest.keyid(key)
        self.builder_id = builder_id or f"{socket.gethostname()}:{os.getpid()}"

    @classmethod
    def from_settings(cls, *, home: Path, embedded: bool,
                      source: str | None = None) -> BuildSigner:
        """The key ``FARM_BUILDER_KEY`` names. Only the embedded farm makes one
        up (under ``FARM_HOME``): a real worker's key is enrolled by an admin,
        and a key nobody enrolled signs artifacts every node refuses."""
        source = (source if source is not None else os.environ.get(BUILDER_KEY_ENV, "")).strip()
        if source and "-----BEGIN" in source:
            raise BuilderKeyMissing(
                f"{BUILDER_KEY_ENV} holds PEM text; give a path to a 0600 file instead (model "
                "code of the same user could read the worker's environment)")
        if source:
            path = Path(source)
            if not path.exists():
                raise BuilderKeyMissing(
                    f"{BUILDER_KEY_ENV}={source}: no such file; create one with "
                    "`farm keys generate --out FILE` and enrol it with `farm keys enroll`")
            key = load_private_key(path)
        elif embedded:
            path = home / DEFAULT_KEY_FILE
            key = load_or_create_signing_key(path)
        else:
            raise BuilderKeyMissing(
                f"{BUILDER_KEY_ENV} is not set: a compile worker signs what it builds with its "
                "own key; create one with `farm keys generate --out FILE`, enrol it with "
                "`farm keys enroll --role builder`, and set FARM_BUILDER_KEY=FILE")
        signer = cls(key)
        log.info("signing builds with builder key %s (%s)", signer.keyid[:16], path)
        return signer

    def sign(self, **fields: Any) -> str:
        """The DSSE envelope (JSON text) of a build statement for ``fields``
        (see ``build_statement``; builder identity and key are this signer's)."""
        stmt = build_statement(builder_id=self.builder_id, builder_keyid=self.keyid,
                               built_at=attest.now_iso(), **fields)
        return attest.canonical_bytes(attest.sign_statement(self._key, stmt)).decode("utf-8")


@functools.lru_cache(maxsize=1)
def worker_signer() -> BuildSigner:
    """This worker process's signer (loaded once; raises ``BuilderKeyMissing``)."""
    from farm.core.settings import get_settings

    s = get_settings()
    return BuildSigner.from_settings(home=s.farm_home, embedded=not s.database_url,
                                     source=s.farm_builder_key)


def attest_artifact(**fields: Any) -> str:
    """The envelope a compile worker stores with an artifact that passed
    verification: ``fields`` are ``build_statement``'s (digest, size, fmt,
    build_key, fingerprint, spec, target, meta, verification), signed with
    this worker's key and identity."""
    return worker_signer().sign(**fields)
