"""The user's code on a build worker: one read-only directory per code pack digest.

A worker fetches a pack from the blob store by its digest, checks the bytes
hash to that digest (the blob store checks too; this is the worker's own
check, independent of the store's implementation), checks every entry
(``farm.core.codepack.check_members``: plain files and directories only,
relative names) and unpacks it once into ``<root>/<digest>``. Every build of
that digest reuses the directory, which the build children get read-only on
their ``sys.path`` (``farm.build.sandbox`` mounts it read-only as well).
A pack with wheels or pinned requirements (``farm.core.wheels``) also gets
``<env root>/<digest>``: those installed by the worker with pip (``env_dir``),
mounted read-only after the pack on the children's path.

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
import subprocess
import sys
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


# --- wheels and pinned requirements of a pack ---------------------------------------------

PIP_TIMEOUT_S = 900.0
# What a failed import of a job with an environment adds to its error.
NO_DEPS_HINT = ("the code pack's wheels and pins are installed without their dependencies "
                "(pip --no-deps): ship each missing one too, with --wheel or a pin in "
                "--requirements")


def env_root(farm_home: str | os.PathLike[str]) -> Path:
    return Path(farm_home) / "code-env"


def has_env(code: Path) -> bool:
    """Whether the unpacked pack ``code`` carries wheels or requirements."""
    from farm.core.wheels import ENV_DIR

    return (code / ENV_DIR).is_dir()


def env_dir(digest: str, code: Path, *, root: str | os.PathLike[str],
            find_links: str = "", index_url: str = "",
            timeout_s: float = PIP_TIMEOUT_S) -> Path | None:
    """The read-only directory where the wheels and pins of the unpacked pack
    ``code`` (of ``digest``) are installed, once per digest, under ``root``;
    None when the pack has neither.

    This runs in the worker, never in the sandbox (which has no network):
    ``pip install --no-deps --target``, wheels with ``--no-index``, pins with
    ``--only-binary :all:`` (an sdist would run its build code here, outside
    the sandbox) and hash-checked when the file has hashes, from
    ``index_url`` or ``find_links`` (FARM_PIP_INDEX_URL, FARM_PIP_FIND_LINKS;
    find-links alone means no index). Torch, triton and the farm are refused
    before and after the install (``farm.core.wheels``). Raises
    ``CodeUnavailable`` with pip's own words when the install fails.
    """
    from farm.core import wheels as wh

    validate_digest(digest)
    if not has_env(code):
        return None
    root = Path(root)
    dest = root / digest
    if dest.is_dir():
        return dest
    wheel_files = sorted((code / wh.WHEELS_DIR).glob("*.whl")) if (
        code / wh.WHEELS_DIR).is_dir() else []
    req = code / wh.REQUIREMENTS_FILE
    try:
        for w in wheel_files:
            wh.check_wheel(w)
        pins = wh.parse_pinned(req.read_text(), source="the pack's requirements") \
            if req.is_file() else []
    except wh.WheelError as exc:
        raise CodeUnavailable(f"code pack {digest[:12]}: {exc}") from None
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(root, 0o755)
    work = Path(tempfile.mkdtemp(prefix=f".install-{digest[:12]}-", dir=root))
    try:
        site = work / "site"
        base = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
                "--no-input", "--disable-pip-version-check", "--no-cache-dir",
                "--no-warn-script-location"]
        if wheel_files:
            _pip([*base, "--no-index", *map(str, wheel_files)], digest=digest,
                 timeout_s=timeout_s)
        if pins:
            source = ["--index-url", index_url] if index_url else (
                ["--no-index"] if find_links else [])
            if find_links:
                source += ["--find-links", find_links]
            hashes = ["--require-hashes"] if pins[0].hashes else []
            _pip([*base, "--only-binary", ":all:", *source, *hashes, "-r", str(req)],
                 digest=digest, timeout_s=timeout_s)
        installed = [p.name for p in site.iterdir()] if site.is_dir() else []
        tops = {n.split(".")[0] for n in installed
                if not n.endswith((".dist-info", ".egg-info")) and n not in ("bin", "__pycache__")}
        try:
            wh.refuse_protected_top_levels(tops, what=f"code pack {digest[:12]}'s environment")
        except wh.WheelError as exc:
            raise CodeUnavailable(str(exc)) from None
        for dirpath, _, filenames in os.walk(site):
            for f in filenames:
                os.chmod(Path(dirpath) / f, 0o444)
            os.chmod(dirpath, 0o555)
        try:
            os.rename(site, dest)
        except OSError:
            if not dest.is_dir():
                raise
        log.info("code pack %s environment installed: %s", digest[:12],
                 ", ".join(sorted(n for n in installed if n.endswith(".dist-info"))))
        return dest
    finally:
        _remove(work)


def _pip(argv: list[str], *, digest: str, timeout_s: float) -> None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CodeUnavailable(f"code pack {digest[:12]}: pip install took over "
                              f"{timeout_s:.0f} s") from None
    if out.returncode != 0:
        lines = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
        why = "\n".join(lines[-8:])
        raise CodeUnavailable(f"code pack {digest[:12]}: pip could not install its wheels or "
                              f"pins (exit {out.returncode}):\n{why}")
