"""The user's code on a build worker: one read-only directory per code pack digest.

A worker fetches a pack from the blob store by its digest, checks the bytes
hash to that digest (the blob store checks too; this is the worker's own
check, independent of the store's implementation), checks every entry
(``farm.core.codepack.check_members``: plain files and directories only,
relative names) and unpacks it once into ``<root>/<digest>``. Every build of
that digest reuses the directory, which the build children get read-only on
their ``sys.path`` (``farm.build.sandbox`` mounts it read-only as well).

Concurrency: an unpack goes to a private temporary directory and is renamed
into place; the rename is atomic, so a directory under its digest's name is
always complete, and two workers unpacking the same pack at once both succeed
(the second one's copy is dropped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from farm.core.codepack import DEFAULT_MAX_BYTES, CodePackError, unpack
from farm.core.digests import sha256_file, validate_digest

log = logging.getLogger(__name__)

# fetch(digest, dest_path): write the blob's bytes to dest_path (the blob store's get_to_file).
Fetch = Callable[[str, Path], object]


class CodeUnavailable(RuntimeError):
    """The job's code pack cannot be fetched or is not a valid pack; the message says why."""


def code_root(farm_home: str | os.PathLike[str]) -> Path:
    return Path(farm_home) / "code"


def code_dir(digest: str, *, fetch: Fetch, root: str | os.PathLike[str],
             max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The unpacked, read-only directory of code pack ``digest`` under ``root``."""
    validate_digest(digest)
    root = Path(root)
    dest = root / digest
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(root, 0o755)  # a sandbox uid only reads it through a bind mount
    work = Path(tempfile.mkdtemp(prefix=f".unpack-{digest[:12]}-", dir=root))
    try:
        blob = work / "pack.tar"
        # The fetch's own errors propagate: the caller tells a missing blob
        # (the job's fault) from an unreachable store (worth a retry).
        fetch(digest, blob)
        actual = sha256_file(blob)
        if actual != digest:
            raise CodeUnavailable(f"code pack {digest[:12]} is corrupt: its bytes hash to "
                                  f"{actual[:12]}")
        if blob.stat().st_size > max_bytes:
            raise CodeUnavailable(f"code pack {digest[:12]} is over the {max_bytes} byte limit")
        tree = work / "tree"
        try:
            files = unpack(blob, tree, max_bytes=max_bytes)
        except CodePackError as exc:
            raise CodeUnavailable(f"code pack {digest[:12]} is not valid: {exc}") from None
        try:
            os.rename(tree, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # Another worker on this machine unpacked it first: same bytes.
        log.info("code pack %s unpacked: %d files", digest[:12], len(files))
        return dest
    finally:
        _remove(work)


def _remove(path: Path) -> None:
    """rmtree that also removes read-only trees (unpacked files are 0444, dirs 0555)."""
    def writable(func: Callable[..., object], p: str, _exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o755)
            os.chmod(p, 0o755)
            func(p)

    shutil.rmtree(path, onerror=writable)
