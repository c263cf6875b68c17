"""What a sandboxed compile child hands back, taken as untrusted input.

The child runs the submitter's code: its result JSON and every file under its
output directory are the submitter's to write. A hostile model can rewrite
the JSON to name any path on the worker (the builder's signing key), or
replace its artifact with a symlink, a hard link, a fifo or a directory.
The worker used to open that path as itself, upload it and sign it.

``take_artifacts`` believes nothing of it:

- the report must have the expected shape, each format once, each a format
  the worker knows, at exactly the file name the worker expects for it
  directly under the child's output directory (so "another path" cannot even
  be named);
- the output directory and the file are opened with ``O_NOFOLLOW`` (no
  symlink is followed, at either level) and ``O_NONBLOCK`` (a fifo cannot
  hang the worker), and the open file must be a regular file with one link
  (a hard link to a file the child could see is another file's bytes);
- the bytes are read once, from that open descriptor, hashed while they are
  copied into a directory of the worker's own; those copied bytes are what
  is verified, uploaded and signed, never the child's path again;
- what the worker measured (size, sha256, and the format's own magic where
  it has one) must agree with what the child said it wrote.

Anything else is a ``ChildOutputError`` whose message says what was wrong;
the worker fails the build with it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The first bytes a format's file must start with, where it has fixed ones:
# an AOTI package is a zip (torch's .pt2). An aot_compile artifact is torch's
# bytes or the farm's zip bundle of them (farm.node.bundle), so it has none.
MAGIC = {"aoti": b"PK\x03\x04"}
CHUNK = 1 << 20


class ChildOutputError(Exception):
    """The child's report or files are not what a build writes: the build fails."""


@dataclass(frozen=True)
class TakenArtifact:
    """One artifact's bytes, copied out of the child's reach."""

    path: Path  # the worker's copy: what is verified, uploaded and signed
    format: str
    meta: dict[str, Any]
    sha256: str
    size: int


def take_artifacts(
    value: Any, out_dir: Path, into: Path, *, names: Mapping[str, str]
) -> list[TakenArtifact]:
    """The artifacts the compile child reported in ``value`` (its result,
    ``{"artifacts": [{"path", "format", "meta"}, ...]}``), each checked and
    copied into ``into`` (a directory of the worker's). ``names`` maps each
    format the worker knows to the file name the build writes it to under
    ``out_dir``. Raises ``ChildOutputError``."""
    arts = _artifact_list(value)
    out_dir = Path(os.path.abspath(out_dir))
    seen: set[str] = set()
    taken = []
    for i, art in enumerate(arts):
        fmt, path, meta = _entry(art, i, names)
        if fmt in seen:
            raise ChildOutputError(f"the compile child reported format {fmt!r} twice")
        seen.add(fmt)
        expected = out_dir / names[fmt]
        # Lexically, before anything is opened: the path must be the one file
        # this format is written to. normpath folds "..": out/../../key is
        # refused here, not resolved.
        if Path(os.path.normpath(os.path.join(out_dir, path))) != expected:
            raise ChildOutputError(
                f"the compile child reported its {fmt} artifact at {path!r}, not at "
                f"{str(expected)!r}, where the build writes it: the build's code rewrote "
                "its result (model code must not touch the farm's build steps)"
            )
        taken.append(_take(fmt, expected, meta, into))
    return taken


def _artifact_list(value: Any) -> list[Any]:
    if not isinstance(value, dict) or not isinstance(value.get("artifacts"), list):
        raise ChildOutputError(
            f'the compile child\'s result is not {{"artifacts": [...]}}: got {type(value).__name__}'
        )
    if not value["artifacts"]:
        raise ChildOutputError("the compile child reported no artifact")
    return list(value["artifacts"])


def _entry(art: Any, i: int, names: Mapping[str, str]) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(art, dict):
        raise ChildOutputError(f"artifact {i} of the compile child's result is not an object")
    fmt, path, meta = art.get("format"), art.get("path"), art.get("meta", {})
    if not isinstance(fmt, str) or fmt not in names:
        raise ChildOutputError(
            f"artifact {i} of the compile child's result has format {fmt!r}; the worker "
            f"builds only {', '.join(sorted(names))}"
        )
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ChildOutputError(f"the {fmt} artifact's path is not a file name: {path!r}")
    if not isinstance(meta, dict):
        raise ChildOutputError(f"the {fmt} artifact's meta is not an object")
    return fmt, path, meta


def _take(fmt: str, path: Path, meta: dict[str, Any], into: Path) -> TakenArtifact:
    dir_fd = _open_dir(path.parent)
    try:
        try:
            fd = os.open(
                path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError as exc:
            # ELOOP: O_NOFOLLOW met a symlink.
            what = "a symlink" if os.path.islink(path) else exc.strerror
            raise ChildOutputError(
                f"the compile child's {fmt} artifact {str(path)!r} cannot be taken: it is "
                f"{what}, not a file the build wrote"
            ) from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ChildOutputError(
                f"the compile child's {fmt} artifact {str(path)!r} is a {_kind(st.st_mode)}, "
                "not a regular file"
            )
        if st.st_nlink != 1:
            raise ChildOutputError(
                f"the compile child's {fmt} artifact {str(path)!r} has {st.st_nlink} links: "
                "a hard link is another file's bytes, not one the build wrote"
            )
        # A regular file: reads block no more; back to blocking for a plain copy.
        os.set_blocking(fd, True)
        dst, sha, size, head = _copy(fd, into, path.name)
    finally:
        os.close(fd)
    _agree(fmt, meta, sha, size, head)
    return TakenArtifact(path=dst, format=fmt, meta=meta, sha256=sha, size=size)


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ChildOutputError(
            f"the compile child's output directory {str(path)!r} cannot be opened as a "
            f"directory ({exc.strerror}): the build's code replaced it"
        ) from None


def _copy(fd: int, into: Path, name: str) -> tuple[Path, str, int, bytes]:
    """Copy ``fd``'s bytes to a new file in ``into``, hashing them on the way."""
    h = hashlib.sha256()
    size = 0
    head = b""
    out_fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=into)
    try:
        with os.fdopen(out_fd, "wb") as out:
            while chunk := os.read(fd, CHUNK):
                if size < 8:
                    head = (head + chunk)[:8]
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
        # Read-only to whoever runs next (the verifier reads it): a change of
        # these bytes after this point also shows at upload (the worker
        # compares the stored digest with this one).
        os.chmod(tmp, 0o444)
        dst = into / name
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst, h.hexdigest(), size, head


def _agree(fmt: str, meta: Mapping[str, Any], sha: str, size: int, head: bytes) -> None:
    said_sha, said_size = meta.get("sha256"), meta.get("size")
    if meta.get("format", fmt) != fmt:
        raise ChildOutputError(
            f"the compile child's {fmt} artifact says it is {meta.get('format')!r}"
        )
    if said_size != size:
        raise ChildOutputError(
            f"the compile child's {fmt} artifact is {size} bytes where the worker read it, "
            f"its report says {said_size!r}: the file changed after it was written"
        )
    if said_sha != sha:
        raise ChildOutputError(
            f"the compile child's {fmt} artifact has sha256 {sha[:12]} where the worker "
            f"read it, its report says {str(said_sha)[:12]!r}: the file changed after it "
            "was written"
        )
    magic = MAGIC.get(fmt)
    if magic is not None and not head.startswith(magic):
        raise ChildOutputError(
            f"the compile child's {fmt} artifact is not a {fmt} file (it starts {head[:4]!r})"
        )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def worker_dir(parent: str | None) -> Path:
    """A fresh directory for taken artifacts: the worker's own, traversable but
    not listable by other uids (its random name is never told to a child
    before the child that could abuse it has ended)."""
    d = Path(tempfile.mkdtemp(prefix="farm-taken-", dir=parent))
    d.chmod(0o711)
    return d
