"""Targets that have live compile workers."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fastapi import APIRouter

from registry import service

from .deps import Reader, State
from .schemas import AUTH

router = APIRouter(tags=["targets"], responses=AUTH)


@router.get("/v1/targets")
def list_targets(state: State, _: Reader) -> dict[str, Any]:
    """Live workers (a heartbeat within three periods) and the targets they build."""
    workers = service.live_workers(state.db, max_age_s=state.heartbeat_max_age_s)
    per_target = Counter(w["target"] for w in workers if w["kind"] == "compile" and w["target"])
    return {
        "targets": [{"target": t, "workers": n, "queue": f"compile.{t}"}
                    for t, n in sorted(per_target.items())],
        "workers": sorted(workers, key=lambda w: (w["kind"], w["id"])),
    }
