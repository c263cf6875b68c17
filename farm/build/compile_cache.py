"""Shared compile caches, one per target: builds reuse what earlier builds compiled.

A build child compiles in caches of its own (``farm.build.steps.compile_env``:
``<build>/inductor-cache`` and ``<build>/triton-cache``). The trusted worker,
never the sandboxed child, talks to the shared store: before the child starts
it copies the target's entries into those directories (``prefill``), and after
the build passed verification it copies the files the child added back
(``harvest``). The child needs no credentials and no network; the store's
address and password never enter the sandbox (docs/security.md).

What is shared is every file Inductor and Triton keep on disk, keyed by torch
itself: compiled C++ kernels (``<xx>/<hash>.so``, keyed by their source and
flags; on CPU the main saving), generated wrappers, the FX graph and
AOTAutograd caches, Triton's compiled kernels. Left out: lock files, and
``.best_config`` autotune results (a CUDA artifact ships every one found in
its cache, ``farm.build.compile.bundle_autotune``: shared ones would bloat it).

Namespaces: ``<prefix>:<sha256(target)[:16]>:<salt>``, then, by default, the
project's part of it (``scoped_namespace``, ``FARM_COMPILE_CACHE_SCOPE``): two
targets never share one, nor two projects, and a new salt (``farm cache salt
TARGET``) disowns every entry before it. A kernel ``.so`` one build planted
ships inside every later artifact that loads it, and verification on sample
inputs cannot see what else it does: so only builds of one project, whose
maintainers could change its models anyway, share entries.
Torch's own keys already hold the torch version and the configuration; the
target adds what they do not (the CPU ISA, the thread count, the GPU).

A poisoned entry cannot reach a node unverified: every artifact is still
verified in a fresh process with an empty cache against eager
(``farm.build.verify``), whatever the cache gave the build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from farm.core.net import is_redis_url

log = logging.getLogger(__name__)

# The child's cache directories, as compile_env names them, and the prefix of
# each one's entries in the store.
CACHE_DIRS = {"inductor": "inductor-cache", "triton": "triton-cache"}
# An entry path: the store's data is not trusted to name paths, so only plain
# relative names are accepted (no "..", no absolute paths, no odd characters).
_ENTRY_RE = re.compile(r"^(inductor|triton)(/[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}){1,6}$")
_SKIP_SUFFIXES = (".lock", ".best_config", ".tmp")
_SKIP_DIRS = {"locks"}

DEFAULT_MAX_ENTRY_BYTES = 64 * 1024**2
DEFAULT_MAX_NAMESPACE_BYTES = 2 * 1024**3
# Redis: a namespace nobody wrote to for this long expires.
DEFAULT_TTL_S = 14 * 24 * 3600


def namespace(target: str, salt: str, *, prefix: str = "farm:ccache",
              model: str | None = None) -> str:
    """The store namespace of ``target``'s cache under ``salt``; with
    ``model`` (``FARM_COMPILE_CACHE_SCOPE=model``), that model's own part of it."""
    t = hashlib.sha256(target.encode()).hexdigest()[:16]
    ns = f"{prefix}:{t}:{salt}"
    if model is not None:
        ns += f":m{hashlib.sha256(model.encode()).hexdigest()[:16]}"
    return ns


# FARM_COMPILE_CACHE_SCOPE: who shares a target's cache. "project" (the
# default): builds of one project only; "model": builds of one model only;
# "target": every build of the target, across projects (an admin's explicit
# choice: one project's build can then plant a kernel another's ships).
SCOPES = ("project", "model", "target")


def scoped_namespace(target: str, salt: str, *, scope: str = "project",
                     project: str | None = None, model: str | None = None,
                     prefix: str = "farm:ccache") -> str:
    """The namespace a build of ``model`` (of ``project``; None: ``default``)
    reads and writes under ``scope``."""
    scope = (scope or "project").strip().lower()
    if scope == "target":
        return namespace(target, salt, prefix=prefix)
    if scope == "model":
        if not model:
            raise ValueError("FARM_COMPILE_CACHE_SCOPE=model needs the build's model name")
        return namespace(target, salt, prefix=prefix, model=model)
    if scope == "project":
        p = hashlib.sha256((project or "default").encode()).hexdigest()[:16]
        return f"{namespace(target, salt, prefix=prefix)}:p{p}"
    raise ValueError(f"FARM_COMPILE_CACHE_SCOPE must be one of {', '.join(SCOPES)}; "
                     f"got {scope!r}")


def valid_entry(rel: str) -> bool:
    return bool(_ENTRY_RE.match(rel)) and ".." not in rel.split("/")


class CacheStore(Protocol):
    def entries(self, ns: str) -> Iterator[tuple[str, bytes]]: ...

    def put(self, ns: str, rel: str, data: bytes) -> bool: ...

    def names(self, ns: str) -> set[str]: ...


class RedisCacheStore:
    """Entries in one Redis hash per namespace (field: the entry's path)."""

    def __init__(self, url: str, *, ttl_s: int = DEFAULT_TTL_S,
                 max_namespace_bytes: int = DEFAULT_MAX_NAMESPACE_BYTES) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.ttl_s = ttl_s
        self.max_namespace_bytes = max_namespace_bytes

    def entries(self, ns: str) -> Iterator[tuple[str, bytes]]:
        for k, v in self.client.hscan_iter(f"{ns}:entries", count=200):
            yield (k.decode() if isinstance(k, bytes) else str(k)), bytes(v)

    def names(self, ns: str) -> set[str]:
        return {k.decode() if isinstance(k, bytes) else str(k)
                for k in self.client.hkeys(f"{ns}:entries")}

    def put(self, ns: str, rel: str, data: bytes) -> bool:
        size_key = f"{ns}:bytes"
        if int(self.client.get(size_key) or 0) + len(data) > self.max_namespace_bytes:
            return False
        if not self.client.hsetnx(f"{ns}:entries", rel, data):
            return False  # the first writer's entry stays: entries never change
        pipe = self.client.pipeline()
        pipe.incrby(size_key, len(data))
        pipe.expire(f"{ns}:entries", self.ttl_s)
        pipe.expire(size_key, self.ttl_s)
        pipe.execute()
        return True


class DirCacheStore:
    """Entries as files under ``root`` (the embedded farm, and bench/build_cost.py)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _dir(self, ns: str) -> Path:
        return self.root / hashlib.sha256(ns.encode()).hexdigest()[:32]

    def entries(self, ns: str) -> Iterator[tuple[str, bytes]]:
        for rel in sorted(self.names(ns)):
            yield rel, (self._dir(ns) / rel).read_bytes()

    def names(self, ns: str) -> set[str]:
        top = self._dir(ns)
        if not top.is_dir():
            return set()
        return {p.relative_to(top).as_posix() for p in top.rglob("*")
                if p.is_file() and not p.name.startswith(".tmp-")}

    def put(self, ns: str, rel: str, data: bytes) -> bool:
        dest = self._dir(ns) / rel
        if dest.exists():
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        return True


@dataclass
class CacheSession:
    """One build's use of the shared cache: ``prefill`` before the child
    runs, ``harvest`` after its artifacts passed verification."""

    store: CacheStore
    ns: str
    build_dir: Path
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    prefilled: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)

    def prefill(self) -> int:
        n = size = bad = 0
        for rel, data in self.store.entries(self.ns):
            if not valid_entry(rel):
                bad += 1
                continue
            kind, _, rest = rel.partition("/")
            dest = self.build_dir / CACHE_DIRS[kind] / rest
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            self.prefilled.add(rel)
            n += 1
            size += len(data)
        self.stats.update(prefilled=n, prefilled_bytes=size, rejected_names=bad)
        return n

    def harvest(self) -> int:
        """Copy the files the child added into the store; returns how many."""
        n = size = 0
        for rel, path in self._new_files():
            data = _read_regular(path, self.max_entry_bytes)
            if data is None:
                continue
            if self.store.put(self.ns, rel, data):
                n += 1
                size += len(data)
        self.stats.update(shared=n, shared_bytes=size)
        return n

    def _new_files(self) -> Iterator[tuple[str, Path]]:
        for kind, sub in CACHE_DIRS.items():
            top = self.build_dir / sub
            if not top.is_dir():
                continue
            # followlinks=False: a link the child made never leads the worker
            # out of the build directory.
            for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
                dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
                for f in filenames:
                    if f.endswith(_SKIP_SUFFIXES):
                        continue
                    p = Path(dirpath) / f
                    rel = f"{kind}/{p.relative_to(top).as_posix()}"
                    if rel in self.prefilled or not valid_entry(rel):
                        continue
                    yield rel, p


def _read_regular(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` if it is a plain file of at most ``max_bytes``
    with one link: never a symlink or a hard link the child pointed at a
    file of the worker's (its keys), which would leak into the store."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > max_bytes:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(max_bytes + 1)[:max_bytes]
    finally:
        os.close(fd)


def open_store(*, mode: str, redis_url: str, farm_home: Path,
               url: str = "") -> CacheStore | None:
    """The store ``FARM_COMPILE_CACHE`` names: ``on`` (Redis where the farm has
    one, else a directory under ``FARM_HOME``), ``redis``, ``dir`` or ``off``.
    ``url`` (``FARM_COMPILE_CACHE_URL``) puts it elsewhere: a ``redis://`` URL
    or a directory."""
    mode = (mode or "on").lower()
    if mode == "off":
        return None
    if mode not in ("on", "redis", "dir"):
        raise ValueError(f"FARM_COMPILE_CACHE must be on, redis, dir or off; got {mode!r}")
    is_redis = is_redis_url(url)
    if url and mode != "on" and is_redis != (mode == "redis"):
        raise ValueError(f"FARM_COMPILE_CACHE={mode} does not fit FARM_COMPILE_CACHE_URL={url!r}: "
                         "a redis:// URL for redis, a directory for dir (or leave one unset)")
    if url:
        return RedisCacheStore(url) if is_redis else DirCacheStore(Path(url))
    if mode == "redis" or (mode == "on" and redis_url):
        if not redis_url:
            raise ValueError("FARM_COMPILE_CACHE=redis needs REDIS_URL")
        return RedisCacheStore(redis_url)
    return DirCacheStore(Path(farm_home) / "compile-cache")
