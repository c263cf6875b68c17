"""Code packs: the user's model code, shipped with the job as one content-addressed blob.

A pack is an uncompressed tar whose bytes depend only on the files' paths,
contents and executable bits: entries sorted, every mtime fixed, owners and
permissions normalised, ``.gitignore`` respected. The same source tree gives
the same digest on every machine (compression is left out for that reason:
a zlib upgrade would change the bytes, hence the build key). Its root is an
import root: ``mymodel.py`` or ``mypkg/__init__.py`` sit at the top, so a
worker puts the unpacked directory on the build child's ``sys.path`` and the
entrypoint imports exactly as it did on the user's machine.

Nothing here imports user code: the source of an entrypoint is found with
path finders only.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import io
import os
import re
import sys
import sysconfig
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# A pack bigger than this is almost always a mistake (a dataset, a venv, a
# checkpoint next to the code); weights never travel with the code.
DEFAULT_MAX_BYTES = 64 * 1024**2
MAX_FILES = 20_000
FIXED_MTIME = 0
# Never packed: byte code, VCS data, editor and OS droppings.
ALWAYS_IGNORED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".mypy_cache",
                                 ".pytest_cache", ".ruff_cache", ".tox", ".ipynb_checkpoints"})
ALWAYS_IGNORED_SUFFIXES = (".pyc", ".pyo")
ALWAYS_IGNORED_NAMES = frozenset({".DS_Store"})
_FILE_ENTRYPOINT_RE = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)$")
_IDENT_RE = re.compile(r"^[A-Za-z_]\w*$")


class CodePackError(ValueError):
    """The code cannot be packed, or a pack is malformed; the message says what to do."""


@dataclass(frozen=True)
class CodePack:
    data: bytes
    digest: str  # sha256 hex of ``data``: the job's ``code_digest``
    files: tuple[str, ...]  # the regular files, in pack order

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class SourcePlan:
    """What ``farm submit`` ships for an entrypoint: the module form of the
    entrypoint and the file or directory to pack (None: nothing to ship, the
    module is installed where the farm runs, e.g. ``farm.zoo``)."""

    entrypoint: str
    source: Path | None
    why: str


# --- finding the code of an entrypoint ------------------------------------------------


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             *(paths.get(k, "") for k in ("purelib", "platlib", "stdlib", "platstdlib"))}
    return [Path(r).resolve() for r in roots if r]


def _installed_top_levels() -> dict[str, str]:
    import importlib.metadata

    try:
        return {k: ", ".join(v) for k, v in importlib.metadata.packages_distributions().items()}
    except Exception:  # a broken distribution's metadata must not stop a submit
        return {}


def _within(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def plan_source(entrypoint: str, *, source: str | os.PathLike[str] | None = None,
                cwd: str | os.PathLike[str] | None = None,
                search_path: Sequence[str] | None = None) -> SourcePlan:
    """Which code to ship for ``entrypoint``.

    - ``./mymodel.py:make`` (any path ending in ``.py``): the module is the
      file's name, or its dotted path inside the packages above it; that file,
      or the topmost package holding it, is shipped.
    - ``mymodel:make`` with ``source``: ``source`` is shipped as it is (a file,
      a package directory, or a directory whose contents are import roots).
    - ``mymodel:make`` without: the module's own file or top-level package,
      found without importing it on ``cwd``, ``PYTHONPATH`` and this
      interpreter's path; nothing when it is installed in this Python (the
      farm's workers are expected to have installed code installed too) or
      not found at all (the farm may have it; its API says when it does not).
    """
    base = Path(cwd or os.getcwd())
    m = _FILE_ENTRYPOINT_RE.match(entrypoint)
    if m:
        file = (base / m.group("path")).resolve()
        if not file.is_file():
            raise CodePackError(f"entrypoint {entrypoint!r}: no file {file}")
        module, top = _module_of_file(file)
        src = Path(source).resolve() if source is not None else top
        return SourcePlan(f"{module}:{m.group('attr')}", src, f"the file {file}")
    from farm.core.specs import ModelRef, SpecError

    try:
        ModelRef(entrypoint=entrypoint)
    except SpecError as exc:
        raise CodePackError(f"{exc}, or a file: './mymodel.py:make'") from None
    module = entrypoint.partition(":")[0]
    if source is not None:
        src = (base / source).resolve()
        if not src.exists():
            raise CodePackError(f"--source {source}: no such file or directory")
        return SourcePlan(entrypoint, src, f"--source {src}")
    top_name = module.split(".")[0]
    dists = _installed_top_levels()
    if top_name in dists:
        # An installed distribution (an editable install too: farm itself).
        return SourcePlan(entrypoint, None, f"{top_name!r} is installed ({dists[top_name]})")
    paths = [str(base), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
             *(search_path if search_path is not None else [p for p in sys.path if p])]
    spec = importlib.machinery.PathFinder.find_spec(top_name, paths)
    if spec is None:
        # Perhaps installed on the farm only; the API says so if it is not.
        return SourcePlan(entrypoint, None, f"{top_name!r} is not found here ({base} or "
                                            "PYTHONPATH): nothing shipped")
    if spec.submodule_search_locations:
        where = Path(next(iter(spec.submodule_search_locations))).resolve()
    elif spec.origin and spec.origin not in ("built-in", "frozen"):
        where = Path(spec.origin).resolve()
    else:
        return SourcePlan(entrypoint, None, f"{top_name!r} is built into Python")
    if _within(where, _installed_roots()):
        return SourcePlan(entrypoint, None, f"{top_name!r} is installed ({where})")
    return SourcePlan(entrypoint, where, f"{top_name!r} found at {where}")


def _module_of_file(file: Path) -> tuple[str, Path]:
    """Dotted module name of ``file`` and the top file or package directory to ship."""
    parts = [file.stem]
    top = file
    d = file.parent
    while (d / "__init__.py").is_file():
        parts.insert(0, d.name)
        top = d
        d = d.parent
    for p in parts:
        if not _IDENT_RE.match(p):
            raise CodePackError(f"{file}: {p!r} is not a Python identifier, so the module "
                                "cannot be imported; rename it")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts), top


# --- packing ----------------------------------------------------------------------------


def _gitignore_spec(directory: Path) -> object | None:
    gi = directory / ".gitignore"
    if not gi.is_file():
        return None
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(gi.read_text(errors="replace").splitlines())


def _ignored(rel_to: list[tuple[Path, object]], path: Path, *, is_dir: bool) -> bool:
    for directory, spec in rel_to:
        try:
            rel = path.relative_to(directory).as_posix()
        except ValueError:
            continue
        if spec.match_file(rel + ("/" if is_dir else "")):  # type: ignore[attr-defined]
            return True
    return False


def collect_files(source: Path) -> list[tuple[str, Path]]:
    """``(name in the pack, file on disk)``, sorted by name.

    A file goes in under its own name; a package directory (one with
    ``__init__.py``) under its name; any other directory contributes its
    contents, which are then import roots. ``.gitignore`` files of the
    shipped directory and below are respected, as are those of the directory
    a single file or package sits in.
    """
    source = source.resolve()
    if source.is_file():
        return [(source.name, source)]
    if not source.is_dir():
        raise CodePackError(f"{source} is neither a file nor a directory")
    prefix = source.name if (source / "__init__.py").is_file() else ""
    specs: list[tuple[Path, object]] = []
    if prefix:
        outer = _gitignore_spec(source.parent)
        if outer is not None:
            specs.append((source.parent, outer))
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
        d = Path(dirpath)
        own = _gitignore_spec(d)
        if own is not None:
            specs.append((d, own))
        keep = []
        for name in sorted(dirnames):
            p = d / name
            if name in ALWAYS_IGNORED_DIRS or (p / "pyvenv.cfg").exists():
                continue
            if p.is_symlink():
                raise CodePackError(f"{p} is a symbolic link: packs hold only regular files "
                                    "and directories; copy what it points at, or .gitignore it")
            if _ignored(specs, p, is_dir=True):
                continue
            keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            p = d / name
            if name in ALWAYS_IGNORED_NAMES or name.endswith(ALWAYS_IGNORED_SUFFIXES):
                continue
            if _ignored(specs, p, is_dir=False):
                continue
            if p.is_symlink() or not p.is_file():
                raise CodePackError(f"{p} is not a regular file (a link, a socket, ...): "
                                    "packs hold only regular files; .gitignore it")
            rel = p.relative_to(source).as_posix()
            out.append((f"{prefix}/{rel}" if prefix else rel, p))
    return sorted(out)


def pack(source: str | os.PathLike[str] | None, *, max_bytes: int = DEFAULT_MAX_BYTES,
         wheels: Sequence[str | os.PathLike[str]] = (),
         requirements: str | os.PathLike[str] | None = None) -> CodePack:
    """A reproducible pack of ``source`` (see ``collect_files``; None: no
    source, only wheels or requirements) with ``wheels`` under
    ``farm.core.wheels.WHEELS_DIR`` and the pins of ``requirements``, sorted,
    as ``REQUIREMENTS_FILE``; raises ``CodePackError`` over ``max_bytes`` or
    ``MAX_FILES``, naming the largest files, and for a wheel or a pin the
    farm refuses (``farm.core.wheels``)."""
    from farm.core import wheels as wh

    files: list[tuple[str, Path | bytes]] = (
        list(collect_files(Path(source))) if source is not None else [])
    what = source if source is not None else "the wheels and requirements"
    if any(n.split("/")[0] == wh.ENV_DIR for n, _ in files):
        raise CodePackError(f"{source} has a {wh.ENV_DIR} entry, a name the farm keeps for "
                            "--wheel and --requirements: rename it")
    try:
        for w in wheels:
            name = wh.check_wheel(w)
            if any(n == f"{wh.WHEELS_DIR}/{name}" for n, _ in files):
                raise CodePackError(f"wheel {name} is given twice")
            files.append((f"{wh.WHEELS_DIR}/{name}", Path(w)))
        if requirements is not None:
            req = Path(requirements)
            try:
                text = req.read_text()
            except OSError as exc:
                raise CodePackError(f"--requirements {req}: {exc.strerror}") from None
            pins = wh.parse_pinned(text, source=str(req))
            files.append((wh.REQUIREMENTS_FILE, wh.canonical_requirements(pins).encode()))
    except wh.WheelError as exc:
        raise CodePackError(str(exc)) from None
    files.sort(key=lambda f: f[0])
    if not files:
        raise CodePackError(f"nothing to pack in {what} (everything is ignored?)")
    if len(files) > MAX_FILES:
        raise CodePackError(f"{what} has {len(files)} files to pack, over {MAX_FILES}: "
                            "point --source at the model's package, or .gitignore the rest")

    def size(f: Path | bytes) -> int:
        return len(f) if isinstance(f, bytes) else f.stat().st_size

    total = sum(size(p) for _, p in files)
    if total > max_bytes:
        big = sorted(files, key=lambda f: -size(f[1]))[:5]
        listing = ", ".join(f"{n} ({size(f) / 2**20:.1f} MB)" for n, f in big)
        raise CodePackError(
            f"the code in {what} is {total / 2**20:.1f} MB, over the "
            f"{max_bytes / 2**20:.0f} MB limit for a code pack (CODE_PACK_MAX_BYTES); the "
            f"largest files: {listing}. Weights and data do not travel with the code: "
            ".gitignore them or point --source at the package")
    buf = io.BytesIO()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in files:
            parents = name.split("/")[:-1]
            for i in range(1, len(parents) + 1):
                d = "/".join(parents[:i])
                if d not in dirs:
                    dirs.add(d)
                    tar.addfile(_info(d, tarfile.DIRTYPE, 0o755, 0))
            if isinstance(path, bytes):
                data, mode = path, 0o644
            else:
                data = path.read_bytes()
                mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(_info(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise CodePackError(f"the pack of {what} is {len(data) / 2**20:.1f} MB, over the "
                            f"{max_bytes / 2**20:.0f} MB limit (CODE_PACK_MAX_BYTES)")
    return CodePack(data=data, digest=hashlib.sha256(data).hexdigest(),
                    files=tuple(n for n, _ in files))


def _info(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.size = size
    ti.mtime = FIXED_MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


# --- checking and unpacking ---------------------------------------------------------------


def check_members(tar: tarfile.TarFile, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The regular files of a pack, after checking that every member is a
    plain file or directory with a relative, normalised name inside the pack
    (no links, devices, absolute paths or ``..``) and that it unpacks within
    ``max_bytes`` and ``MAX_FILES``. Raises ``CodePackError``."""
    names: list[str] = []
    total = 0
    seen: set[str] = set()
    for count, ti in enumerate(tar, start=1):
        if count > MAX_FILES:
            raise CodePackError(f"code pack has more than {MAX_FILES} entries")
        name = ti.name
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or "\0" in name
                or any(p in ("", ".", "..") for p in parts)):
            raise CodePackError(f"code pack entry {name!r} is not a plain relative path")
        if name in seen:
            raise CodePackError(f"code pack has {name!r} twice")
        seen.add(name)
        if ti.isdir():
            continue
        if not ti.isreg():
            raise CodePackError(f"code pack entry {name!r} is not a regular file or directory")
        total += ti.size
        if total > max_bytes:
            raise CodePackError(f"code pack unpacks to more than {max_bytes} bytes")
        names.append(name)
    if not names:
        raise CodePackError("code pack holds no files")
    return names


def check_pack_bytes(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """``check_members`` for a pack in memory (the API's check of an upload)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            names = check_members(tar, max_bytes=max_bytes)
            _check_env_entries(tar, names)
            return names
    except tarfile.TarError as exc:
        raise CodePackError(f"not a code pack (an uncompressed tar): {exc}") from None


def _check_env_entries(tar: tarfile.TarFile, names: list[str]) -> None:
    """The pack's wheels and pins, as ``farm submit`` checks them: a pack
    uploaded by other means is refused at the upload, not at its first build."""
    import tempfile

    from farm.core import wheels as wh

    try:
        for name in names:
            if name.split("/")[0] != wh.ENV_DIR:
                continue
            member = tar.extractfile(name)
            body = member.read() if member is not None else b""
            if name == wh.REQUIREMENTS_FILE:
                wh.parse_pinned(body.decode("utf-8", "replace"), source="its requirements")
            elif name.startswith(wh.WHEELS_DIR + "/") and name.count("/") == 2:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp, name.rsplit("/", 1)[1])
                    path.write_bytes(body)
                    wh.check_wheel(path)
            else:
                raise CodePackError(f"{name}: {wh.ENV_DIR}/ holds only wheels/<name>.whl and "
                                    "requirements.txt")
    except wh.WheelError as exc:
        raise CodePackError(str(exc)) from None


def unpack(pack_file: str | os.PathLike[str], dest: str | os.PathLike[str], *,
           max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Check, then extract ``pack_file`` into the new directory ``dest``
    (which must not exist). Files come out read-only, whatever the pack says."""
    dest = Path(dest)
    dest.mkdir(parents=False, exist_ok=False)
    try:
        with tarfile.open(pack_file, mode="r:") as tar:
            names = check_members(tar, max_bytes=max_bytes)
            # "data" refuses links, devices and paths outside dest (a second
            # line behind check_members) and drops owners and odd modes.
            tar.extractall(dest, filter="data")
    except tarfile.TarError as exc:
        raise CodePackError(f"not a code pack (an uncompressed tar): {exc}") from None
    for dirpath, _, filenames in os.walk(dest):
        for f in filenames:
            os.chmod(Path(dirpath) / f, 0o444)
        os.chmod(dirpath, 0o555)
    return names
