"""The environment a build child gets: the farm's secrets and settings
scrubbed from it (``scrubbed_env``), an isolated child's allow-list
(``allowed_env``), and a PATH without C/C++ compilers for checks that must
not compile (``without_compilers``: the verifier, a cold node)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

# Exact names and name prefixes of environment variables that the child never
# sees: the farm's database, broker, blob store and signing credentials, and
# cloud credentials that model code could use to reach the farm's bucket.
SCRUBBED = frozenset({
    "DATABASE_URL",
    "REDIS_URL",
    "BROKER_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "BLOB_STORE_URL",
    "FARM_TOKEN",
    "FARM_ADMIN_TOKEN",
    "FARM_SIGNING_KEY",
    # Where the worker's builder key and the API's name key are (docs/security.md).
    "FARM_BUILDER_KEY",
    "FARM_NAME_KEY",
    "SSH_AUTH_SOCK",
    "GOOGLE_APPLICATION_CREDENTIALS",
})
# libpq's PG* variables reach the database with no URL at all (PGHOST, PGUSER).
SCRUBBED_PREFIXES = ("AWS_", "S3_", "MINIO_", "AZURE_", "PG", "CELERY_")
# The farm's own configuration goes too (every variable ``farm.core.settings``
# reads, and the workers' knobs): it names the database, the broker, the
# bucket and where the signing key and SQLite file live (FARM_HOME).
# Settings the children read themselves (CHILD_SETTINGS: FARM_COORDESC) stay.
FARM_KNOBS = frozenset({"FARM_ISA_CACHE", "FARM_AOTI_CHECK_CACHE", "FARM_PCH_STORE",
                        "FARM_BYTECODE_CACHE"})
# Anything that looks like a secret by name goes too.
SCRUBBED_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE_KEY")

# C/C++ compiler names hidden by ``without_compilers`` (inductor looks up g++,
# c++, clang++ and the CXX variable).
COMPILER_NAMES = ("gcc", "g++", "cc", "c++", "c89", "c99", "clang", "clang++", "icx", "icpx", "cpp")
# gcc, g++-12, x86_64-linux-gnu-g++-12, clang++-17; not gcc-ar or c++filt.
_COMPILER_RE = re.compile(
    r"^(?:[A-Za-z0-9_.]+-)*(?:"
    + "|".join(re.escape(c) for c in COMPILER_NAMES)
    + r")(?:-[0-9.]+)?$"
)


# Environment variables an isolated child keeps (then scrubbed as usual):
# locale, the Python, torch, compiler and accelerator runtime knobs. A value
# under any other name, however innocent it looks, stays with the worker.
ENV_ALLOWED = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONHASHSEED",
                         "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                         "PYTHONWARNINGS", "CC", "CXX", "CPP", "LD_LIBRARY_PATH",
                         "FARM_COORDESC"})
ENV_ALLOWED_PREFIXES = ("LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "TRITON_", "CUDA_",
                        "NVIDIA_", "CUBLAS", "CUDNN_", "NCCL_", "PYTORCH_", "INDUCTOR_")


def scrubbed_env(
    base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) without the farm's secrets,
    then ``extra`` on top (the caller's explicit choice, never scrubbed)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not _is_secret(k)}
    env.update(extra or {})
    return env


@functools.lru_cache(maxsize=1)
def _farm_settings() -> frozenset[str]:
    from farm.core.settings import CHILD_SETTINGS, Settings

    names = set(Settings.model_fields) - CHILD_SETTINGS
    return frozenset(name.upper() for name in names) | FARM_KNOBS


def _is_secret(name: str) -> bool:
    upper = name.upper()
    return (
        upper in SCRUBBED
        or upper in _farm_settings()
        or upper.startswith(SCRUBBED_PREFIXES)
        or any(m in upper for m in SCRUBBED_MARKERS)
    )


def allowed_env(env: Mapping[str, str], extra: Mapping[str, str] | None) -> dict[str, str]:
    keep = {k: v for k, v in env.items()
            if k in ENV_ALLOWED or k.startswith(ENV_ALLOWED_PREFIXES)}
    keep.update(extra or {})
    return keep



def sandbox_user(workdir: Path) -> dict[str, str]:
    """Who an isolated process is: the sandbox user, its HOME under
    ``workdir`` (made here), the sandbox's private /tmp."""
    (workdir / "home").mkdir(exist_ok=True)
    return {"HOME": str(workdir / "home"), "USER": "sandbox", "LOGNAME": "sandbox",
            "TMPDIR": "/tmp"}

_NO_CC_DIR: Path | None = None
_NO_CC_LOCK = threading.Lock()


def _is_compiler(name: str) -> bool:
    return _COMPILER_RE.match(name) is not None


def _remove_own(path: Path, pid: int) -> None:
    """At exit, remove what this process made (not what a fork inherited)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def without_compilers(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) as seen by a node with no C/C++ compiler.

    PATH becomes one directory of links to every executable on the original
    PATH except compilers, and CC/CXX are unset: a child can still run the
    ordinary tools it finds on PATH but cannot compile C++.
    """
    global _NO_CC_DIR
    env = dict(os.environ if env is None else env)
    path = env.get("PATH", os.defpath)
    with _NO_CC_LOCK:
        if _NO_CC_DIR is None or not _NO_CC_DIR.exists():
            d = Path(tempfile.mkdtemp(prefix="farm-nocc-bin-"))
            for entry in path.split(os.pathsep):
                p = Path(entry)
                if not p.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    for exe in p.iterdir():
                        if _is_compiler(exe.name) or (d / exe.name).exists():
                            continue
                        if exe.is_file() and os.access(exe, os.X_OK):
                            with contextlib.suppress(OSError):
                                (d / exe.name).symlink_to(exe)
            _NO_CC_DIR = d
            atexit.register(_remove_own, d, os.getpid())
    env["PATH"] = str(_NO_CC_DIR)
    for var in ("CC", "CXX", "CPP", "TORCHINDUCTOR_CPP_COMPILER"):
        env.pop(var, None)
    return env


def compilers_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """Which compilers ``env``'s PATH finds (empty: none)."""
    path = env.get("PATH", "")
    found = {}
    for name in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        where = shutil.which(name, path=path)
        if where:
            found[name] = where
    return found


def compiler_free_dir() -> Path | None:
    """The directory ``without_compilers`` made this process's PATH of (None
    before its first call): an isolated child is given it read-only."""
    return _NO_CC_DIR
