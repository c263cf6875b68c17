"""Content addresses: every blob, cache entry and download is named by the
sha256 of its bytes, and a name is checked before it can become a path or a
key (which is what keeps ``../`` out of every store)."""

from __future__ import annotations

import hashlib
import os
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


def sha256_file(path: str | os.PathLike[str], *, chunk_size: int = 1 << 20) -> str:
    """The content address of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename into ``path`` durable; not every platform can open a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
