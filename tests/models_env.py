"""Model factories for the fault and hostile-model tests (not shipped in farm.zoo).

Each is named in a job spec as ``tests.models_env:<factory>``; the farm runs it
in its sandbox children: the trace step, the compile step and the verifier.
``stage()`` tells them apart by the sandbox target on the child's command line,
so a factory can misbehave in one stage only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from torch import nn

# What model code must never see: the farm's database, broker, bucket, tokens
# and signing key, and any cloud or libpq credential.
FORBIDDEN = re.compile(
    r"^(DATABASE_URL|REDIS_URL|BROKER_URL|BLOB_STORE_URL|S3_.*|AWS_.*|FARM_.*|PG.*|CELERY_.*)$"
    r"|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY",
    re.IGNORECASE,
)


def stage() -> str:
    """'trace', 'compile', 'verify' (or 'other' outside the farm's sandbox)."""
    target = sys.argv[1] if len(sys.argv) > 1 else ""
    for name in ("trace", "compile", "verify"):
        if name in target.rpartition(":")[2]:
            return name
    return "other"


def env_probe(record: str, dim: int = 8) -> nn.Module:
    """Records which credential-like variables it can see (names only, never
    values) with its stage and pid, one JSON line per call to ``record``; fails
    its build if it saw any."""
    visible = sorted(k for k in os.environ if FORBIDDEN.search(k))
    line = {"stage": stage(), "pid": os.getpid(), "visible": visible,
            "env_size": len(os.environ)}
    # An isolated build child cannot write outside its build directory: the
    # record is then empty, and the build's success says the probe saw nothing.
    with contextlib.suppress(OSError), open(record, "a") as f:
        f.write(json.dumps(line) + "\n")
    if visible:
        raise RuntimeError(f"model code can see the farm's credentials: {visible}")
    return nn.Linear(dim, dim, bias=False)


def slow_once(marker: str, seconds: float = 60.0, dim: int = 8, out: int = 4) -> nn.Module:
    """Sleeps ``seconds`` the first time it is called (when ``marker`` does not
    exist yet, which it then creates): a trace that is still running when the
    test kills its worker, and quick everywhere after. The module is
    ``tests.models.broken:linear(dim, out)``'s: the same graph, so the same build."""
    path = Path(marker)
    if not path.exists():
        # Whole or not at all: the test reads the pid as soon as the name appears.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(str(os.getpid()))
        tmp.replace(path)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.2)
    return nn.Linear(dim, out, bias=False)


def slow_in(at: str, seconds: float, record: str | None = None, dim: int = 8,
            out: int = 4) -> nn.Module:
    """A Linear that takes ``seconds`` in stage ``at``: a build longer than
    the broker's visibility timeout, or one still running when a test kills
    its worker or takes its host away, at next to no CPU (a model that
    compiles for that long costs a loaded 2-core machine tens of CPU-seconds
    each time it is built). With ``record``, it appends a ``start PID PPID``
    and an ``end PID PPID`` line there around the wait (unisolated farms: an
    isolated child cannot write there)."""
    def note(what: str) -> None:
        if record is not None:
            with open(record, "a") as f:
                f.write(f"{what} {os.getpid()} {os.getppid()}\n")

    if stage() == at:
        note("start")
        time.sleep(seconds)
        note("end")
    return nn.Linear(dim, out, bias=False)


def stage_bomb(how: str, at: str, dim: int = 8) -> nn.Module:
    """A healthy Linear, except in stage ``at``, where it raises, hangs,
    crashes the interpreter (SIGSEGV) or allocates until it is stopped."""
    if stage() == at:
        if how == "raise":
            raise RuntimeError(f"bomb in {at}")
        if how == "hang":
            while True:
                time.sleep(1.0)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
        if how == "hog":
            hoard = []
            while True:
                hoard.append(bytearray(b"\x01" * (64 << 20)))
        if how == "tmpfs":
            # Memory no process maps: files in the sandbox's /tmp, held.
            chunk, i = b"\x01" * (64 << 20), 0
            with contextlib.suppress(OSError):
                while True:
                    Path(f"/tmp/fill-{i}").write_bytes(chunk)
                    i += 1
            while True:
                time.sleep(1.0)
        if how == "forkbomb":
            # Forks until the kernel refuses, then holds every process.
            with contextlib.suppress(OSError):
                while True:
                    if os.fork() == 0:
                        while True:
                            time.sleep(60)
            while True:
                time.sleep(1.0)
        raise ValueError(f"unknown bomb {how!r}")
    return nn.Linear(dim, dim, bias=False)


def result_thief(how: str, key: str, dim: int = 8) -> nn.Module:
    """A healthy Linear whose compile child tries to get the worker to upload
    and sign the file ``key`` (the builder's signing key, wherever the worker
    keeps it) as its artifact, as an attacker who read the farm's docs would:

    - ``how="rewrite"``: the result JSON the child hands back names ``key``
      as the artifact's path (``json.dumps`` wrapped, so the farm's own
      writer of the result writes it);
    - ``how="symlink"``: the artifact file is replaced with a symlink to
      ``key`` just before the result is written.

    In the verifier, it reports a passed verification whatever it loaded
    (the verifier runs the submitter's code too)."""
    where = stage()
    if where in ("compile", "verify") and not getattr(json.dumps, "thief", False):
        real = json.dumps

        def dumps(obj: object, *args: object, **kwargs: object) -> str:
            value = obj.get("value") if isinstance(obj, dict) else None
            if isinstance(value, dict) and where == "compile" and "artifacts" in value:
                for art in value["artifacts"]:
                    if how == "rewrite":
                        art["path"] = key
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(art["path"])
                        os.symlink(key, art["path"])
            if isinstance(value, dict) and where == "verify":
                obj = {"ok": True, "value": {"ok": True}}
            return real(obj, *args, **kwargs)  # type: ignore[arg-type]

        dumps.thief = True  # type: ignore[attr-defined]
        json.dumps = dumps  # type: ignore[assignment]
    return nn.Linear(dim, dim, bias=False)
