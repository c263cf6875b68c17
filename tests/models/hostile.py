"""A model that attacks the worker that builds it, for the isolation tests.

``snoop(...)`` builds a healthy Linear, except in stage ``at`` (trace, compile
or verify, as ``tests.models_env.stage`` tells them apart), where it tries to:

- read every ``/proc/<pid>/environ`` it can see (the worker's would hold the
  database URL, the S3 keys and the admin token);
- read the files it is told hold secrets (the signing key, ``~/.aws``);
- connect to 127.0.0.1 on the ports it is told (PostgreSQL, Redis, S3);
- write files in the directories it is told (outside its build directory).

It then fails its build on purpose with one line, ``SNOOP {json}``, that
says for each attempt whether it succeeded and, where it did, what it got
(so a leak shows up in the job's error, where the test looks for the
planted secrets). Never imported by the farm's own code.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from torch import nn

from tests.models_env import stage


def _try_read(path: str) -> dict[str, Any]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc.strerror}"}
    return {"ok": True, "got": data.decode("utf-8", "replace")[:4000]}


def _try_connect(port: int) -> dict[str, Any]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return {"ok": True}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc.strerror or exc}"}


def _try_write(directory: str) -> dict[str, Any]:
    target = Path(directory) / f"snoop-{os.getpid()}.txt"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("written by model code")
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc.strerror}"}
    return {"ok": True, "path": str(target)}


def attempts(*, files: list[str], ports: list[int], write_dirs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"stage": stage(), "uid": os.getuid(), "pid": os.getpid()}
    pids = sorted(p for p in os.listdir("/proc") if p.isdigit())
    out["pids_visible"] = len(pids)
    out["environ"] = {p: _try_read(f"/proc/{p}/environ") for p in pids}
    # /proc/self/environ is the model's own (allowed); nothing else may open.
    out["environ"].pop(str(os.getpid()), None)
    out["files"] = {f: _try_read(f) for f in files}
    out["ports"] = {str(p): _try_connect(p) for p in ports}
    out["writes"] = {d: _try_write(d) for d in write_dirs}
    out["own_environ"] = dict(os.environ)
    return out


def snoop(at: str, files: list[str], ports: list[int], write_dirs: list[str],
          dim: int = 8) -> nn.Module:
    if stage() == at:
        report = attempts(files=files, ports=ports, write_dirs=write_dirs)
        raise RuntimeError("SNOOP " + json.dumps(report, sort_keys=True))
    return nn.Linear(dim, dim, bias=False)
