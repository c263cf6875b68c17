"""What a fleet node trusts, and how it checks: ``FarmTrust`` adds to the
API's calls (``FarmAdmin``) the farm's root key, the trust list that key
signs, and the check of a resolve answer's attestations against the node's
own request. ``FarmClient`` (``farm.node.client``) fetches and loads only
what passed it.

Trust (docs/security.md). Loading an artifact unpickles or dlopens it, which
runs code. Before any byte is loaded the client checks, with
``farm.node.verify``: the trust list against the root key this node pins;
the build statement (signed by an enrolled, unrevoked builder key) and the
version and alias statements (signed by the farm's name key) against its
own request, field by field; and the bytes against the attested digest.

The root key comes from the ``root_key`` argument or ``FARM_ROOT_KEY`` (PEM
text or a path). Only for a farm on a loopback address (the embedded
default) is it fetched and trusted on first use, with a warning, and pinned
per farm URL under the cache directory. Plain ``http://`` to any other host
is refused unless ``FARM_ALLOW_HTTP`` (or ``allow_http=True``) says otherwise.

Split out of farm.node.client; the bodies are as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from farm.node.admin import FarmAdmin
from farm.node.arguments import is_loopback
from farm.node.cache import ArtifactCache
from farm.node.errors import FarmError, FarmUnavailable, IntegrityError, NotFoundError
from farm.node.http import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from farm.core.attest import TrustList
    from farm.node.verify import NodeRequest, TrustStore, Verified

log = logging.getLogger(__name__)

# How long a fetched trust list is used before asking again: a revocation
# reaches every node within this (once the admin has signed the new list).
TRUST_LIST_TTL_S = 30.0
# The key the client keeps its own request under in a resolve answer
# (always overwritten: the farm's answer never supplies it).
NODE_REQUEST = "node_request"


def pin_path(cache_root: Path, url: str) -> Path:
    """Where a node keeps the root key it pinned for the farm at ``url`` on
    first use (a loopback farm only)."""
    name = hashlib.sha256(url.encode()).hexdigest()[:16]
    return cache_root / "trusted-keys" / f"{name}.root.pem"


class FarmTrust(FarmAdmin):
    """``FarmAdmin``'s calls, and this node's trust in the farm: the root key
    (``root_key``, else ``FARM_ROOT_KEY``, else pinned on first use for a
    loopback farm), the trust list, attestation checks. Its state lives
    under the artifact cache's directory (``cache``). Safe to share between
    threads."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        root_key: Any = None,
        public_key: Any = None,
        cache: ArtifactCache | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        allow_http: bool | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        from farm.core.settings import get_settings

        super().__init__(url, token, timeout=timeout, retries=retries, allow_http=allow_http,
                         transport=transport)
        # ``public_key`` is the older name of the same argument: the key the
        # farm's chain of trust starts from.
        source = root_key if root_key is not None else public_key
        self._public_key_source = source if source is not None else (
            get_settings().farm_root_key or None)
        self._public_key: Ed25519PublicKey | None = None
        self._key_lock = threading.Lock()
        self._trust: tuple[float, TrustList] | None = None
        self._trust_lock = threading.Lock()
        self._cache = cache
        self._cache_lock = threading.Lock()

    @property
    def cache(self) -> ArtifactCache:
        with self._cache_lock:
            if self._cache is None:
                self._cache = ArtifactCache.from_settings()
            return self._cache

    def public_key(self) -> Ed25519PublicKey:
        """The root key the trust list must be signed with (see the module docstring)."""
        from farm.core.keys import SigningKeyError, load_public_key

        with self._key_lock:
            if self._public_key is not None:
                return self._public_key
            try:
                if self._public_key_source is not None:
                    key = load_public_key(self._public_key_source)
                else:
                    key = self._pinned_key()
            except SigningKeyError as exc:
                raise IntegrityError(f"farm root key: {exc}") from None
            self._public_key = key
            return key

    def _pin_path(self) -> Path:
        return pin_path(self.cache.root, self.url)

    def root_key_origin(self) -> str:
        """Where this node's root key for the farm comes from, and what to do
        when the farm's trust list is not signed by it (for error messages)."""
        if self._public_key_source is not None:
            return ("the root key this node was given (FARM_ROOT_KEY or root_key=); set it to "
                    f"the root public key of the farm at {self.url}")
        return (f"the root key this node pinned for {self.url} on first use, in "
                f"{self._pin_path()}; if that farm was reset (a new FARM_HOME) and you trust "
                f"it, run `farm trust reset {self.url}` and retry")

    def _pinned_key(self) -> Ed25519PublicKey:
        from farm.core.keys import key_id, load_public_key, public_key_pem

        pin = self._pin_path()
        if pin.exists():
            return load_public_key(pin)
        if not is_loopback(self.url):
            # Trust on first use over a network is trusting whoever answers first.
            raise IntegrityError(
                f"no root key configured for {self.url}: set FARM_ROOT_KEY to the farm's root "
                "public key (`farm keys generate-root` wrote it); trust on first use is only "
                "for a farm on this machine")
        try:
            r = self._http.get("/v1/root-key")
        except httpx.TransportError as exc:
            raise FarmUnavailable(f"cannot reach the farm at {self.url} for its root key: "
                                  f"{exc or type(exc).__name__}") from None
        self._raise_for(r, "GET /v1/root-key")
        key = load_public_key(r.text)
        pin.parent.mkdir(parents=True, exist_ok=True)
        tmp = pin.with_name(f".{pin.name}.{os.getpid()}.tmp")
        tmp.write_text(public_key_pem(key))
        with contextlib.suppress(FileExistsError):
            # First writer wins; everyone then trusts what is on disk.
            os.link(tmp, pin)
        tmp.unlink()
        log.warning("trusting the root key %s of the local farm %s on first use (pinned in %s); "
                    "set FARM_ROOT_KEY to configure it instead", key_id(key), self.url, pin)
        return load_public_key(pin)

    def trust_store(self) -> TrustStore:
        from farm.node.verify import TrustStore

        return TrustStore(self.cache.root / "trust")

    def trust_list(self, *, refresh: bool = False) -> TrustList:
        """The farm's trust list, verified by the root key; never older than
        one this node accepted before (kept under the cache directory)."""
        from farm.core import attest
        from farm.node.verify import AttestationRefused

        with self._trust_lock:
            now = time.monotonic()
            if self._trust is not None and not refresh and now - self._trust[0] < TRUST_LIST_TTL_S:
                return self._trust[1]
            root = self.public_key()
            fetched = None
            try:
                body = self._request("GET", "/v1/trust-list")
            except NotFoundError:
                body = None
            except FarmUnavailable as exc:
                # Offline (a node running what it prefetched): the newest list
                # this node accepted before, verified again; none, and it refuses.
                log.warning("torch-farm: cannot fetch the trust list (%s); using the one this "
                            "node kept", exc)
                body = None
            if body is not None:
                try:
                    fetched = attest.verify_trust_list(body, root)
                except attest.AttestationError as exc:
                    message = str(exc)
                    if exc.field == "trust_list":
                        # Another root signed it: say which key refused it and how to re-trust.
                        origin = self.root_key_origin()
                        message += f"; the farm's trust list is not signed by {origin}"
                    raise AttestationRefused(message, field=exc.field) from None
            tl = self.trust_store().accept_trust_list(fetched, root)
            self._trust = (now, tl)
            return tl

    def put_trust_list(self, envelope: Mapping[str, Any]) -> dict[str, Any]:
        """Upload a trust list the admin signed offline (admin)."""
        with self._trust_lock:
            self._trust = None
        return dict(self._request("PUT", "/v1/trust-list", json=dict(envelope)))

    def verify_signature(self, resolved: Mapping[str, Any], *,
                         request: NodeRequest | None = None) -> Verified:
        """Check the attestations of a resolve answer against this node's
        request; returns what verified, or raises ``AttestationRefused`` (an
        ``IntegrityError``) naming the field. Needs no bytes: call it before
        downloading."""
        from farm.node.verify import AttestationRefused, NodeRequest, verify_attestation

        artifact = resolved.get("artifact", resolved)
        if not isinstance(artifact, Mapping):
            raise FarmError("verify needs a resolve answer or its 'artifact'")
        if request is None:
            raw = resolved.get(NODE_REQUEST)
            if not isinstance(raw, Mapping):
                raise FarmError("verify needs the node's own request: pass the answer of "
                                "FarmClient.resolve, or request=NodeRequest(...)")
            request = NodeRequest.from_json(raw)
        bundle = self.complete_attestation(artifact.get("attestation"))
        if not isinstance(bundle, Mapping):
            raise AttestationRefused(f"artifact {str(artifact.get('digest'))[:12]} carries no "
                                     "attestation", field="attestation")
        seen = None
        if request.ref is not None:
            seen = self.trust_store().alias_seen(self.url, request.model, request.ref)
        claimed = {**artifact, "version": resolved.get("version", artifact.get("version"))}
        return verify_attestation(bundle, self.trust_list(), request, claimed=claimed,
                                  alias_seen=seen)

    def complete_attestation(self, bundle: Any) -> Any:
        """A resolve answer's attestation with its build statement in it: the
        answer names the statement by digest (``build_statement``), and it is
        fetched, or found in this node's cache, by that digest."""
        if not isinstance(bundle, Mapping) or bundle.get("build") is not None:
            return bundle
        named = bundle.get("build_statement")
        if not isinstance(named, Mapping):
            return bundle
        return {**bundle, "build": self.build_statement(named.get("digest"))}

    def build_statement(self, digest: Any) -> dict[str, Any]:
        """The build statement whose sha256 is ``digest``: kept by this node
        (``statements/<digest>.json`` in its cache) or fetched from
        ``/v1/attestations/<digest>`` and kept. Only the digest is checked
        here; the caller verifies its signature and fields as always."""
        import json

        from farm.node.cache import CacheError, validate_digest

        try:
            digest = validate_digest(digest)
        except CacheError as exc:
            raise IntegrityError(f"the farm named a build statement by a bad digest: {exc}") \
                from None
        path = self.cache.root / "statements" / f"{digest}.json"
        data: bytes | None = None
        with contextlib.suppress(OSError):
            data = path.read_bytes()
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            try:
                r = self._http.get(f"/v1/attestations/{digest}")
            except httpx.TransportError as exc:
                raise FarmUnavailable(f"cannot reach the farm at {self.url} for build statement "
                                      f"{digest[:12]}: {exc or type(exc).__name__}") from None
            if r.status_code == 404:
                # The answer named a statement the farm does not have: refused
                # as any other answer whose attestation does not check out.
                raise IntegrityError(f"the farm's answer names build statement {digest[:12]}, "
                                     "which the farm does not have")
            self._raise_for(r, f"GET build statement {digest[:12]}")
            data = r.content
            if hashlib.sha256(data).hexdigest() != digest:
                raise IntegrityError(f"the farm's build statement {digest[:12]} does not hash to "
                                     "its digest")
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
        try:
            statement = json.loads(data)
        except ValueError:
            raise IntegrityError(f"build statement {digest[:12]} is not JSON") from None
        if not isinstance(statement, dict):
            raise IntegrityError(f"build statement {digest[:12]} is not a JSON object")
        return statement
