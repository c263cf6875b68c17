"""Entry points that the sandbox runs in a child process.

Each takes and returns JSON-able dicts, so the parent (a Celery worker) never
imports model code or holds a model in its own memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farm.core.specs import JobSpec


def trace_step(payload: dict[str, Any]) -> dict[str, Any]:
    from farm.build.trace import trace

    report = trace(JobSpec.from_json(payload["spec"]))
    return report.to_json()


def compile_env(build_dir: str | Path) -> dict[str, str]:
    """Environment for a compile child: an Inductor and Triton cache of the
    build's own, so what the build tunes is exactly what ships with it."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(Path(build_dir) / "inductor-cache"),
        "TRITON_CACHE_DIR": str(Path(build_dir) / "triton-cache"),
    }


def compile_step(payload: dict[str, Any]) -> dict[str, Any]:
    from farm.build.compile import CHECK_AOTI, compile_artifacts

    spec = JobSpec.from_json(payload["spec"])
    # The worker answers farm.build.aoti_check outside the sandbox (it is the
    # host's question, and must not spend the model's time limit).
    arts = compile_artifacts(spec, payload["device"], Path(payload["out_dir"]),
                             aoti_unavailable=payload.get("aoti_unavailable", CHECK_AOTI))
    return {"artifacts": [{"path": str(a.path), "format": a.format, "meta": a.meta} for a in arts]}
