"""Content addresses: every blob, cache entry and download is named by the
sha256 of its bytes, and a name is checked before it can become a path or a
key (which is what keeps ``../`` out of every store)."""

from __future__ import annotations

import re

DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class InvalidDigest(ValueError):
    """Not a sha256 hex digest."""


def is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None


def validate_digest(digest: object) -> str:
    """Return ``digest`` if it is 64 lowercase hex characters, else raise ``InvalidDigest``."""
    if not is_digest(digest):
        shown = repr(digest)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise InvalidDigest(f"invalid sha256 digest {shown}: expected 64 lowercase hex characters")
    assert isinstance(digest, str)
    return digest
