"""Entry points that the sandbox runs in a child process.

Each takes and returns JSON-able dicts, so the parent (a Celery worker) never
imports model code or holds a model in its own memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from farm.core.specs import JobSpec


def trace_step(payload: dict[str, Any]) -> dict[str, Any]:
    from farm.build.trace import trace

    report = trace(JobSpec.from_json(payload["spec"]))
    return report.to_json()


# The trace worker's target for run_isolated; its zygote preloads less
# (farm.build.zygote.preload_for), so both name it from here.
TRACE_STEP = f"{__name__}:{trace_step.__name__}"


def compile_env(build_dir: str | Path) -> dict[str, str]:
    """Environment for a compile child: an Inductor and Triton cache of the
    build's own, so what the build tunes is exactly what ships with it, and
    ``toolchain_env()``."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(Path(build_dir) / "inductor-cache"),
        "TRITON_CACHE_DIR": str(Path(build_dir) / "triton-cache"),
        **toolchain_env(),
    }


def toolchain_env() -> dict[str, str]:
    """What a compile worker's children read at import about the C++
    toolchain: the compiler this worker chose (``farm.build.toolchain``),
    named rather than left to the inherited ``CXX``; precompiled headers from
    this machine's store only (``farm.build.pch``); Inductor's ISA checks
    skipped where they are redundant.

    The compile child and the verification of an aot_compile artifact both
    carry it, so both fork from one zygote (``farm.build.zygote`` keeps one
    per import-time environment; with different ones every compile worker
    started a second, 4 s of CPU and an interpreter's memory). The verifier
    compiles nothing with it: loading must not compile at all, and it checks
    that (``farm.build.compile_watch``)."""
    from farm.build import pch
    from farm.build.toolchain import current_compiler
    from farm.core.cpu_isa import isa_check_env

    # torch's own precompiled header keeps it under /tmp (the sandbox's,
    # emptied after every child) and builds it (150 MB, 30 s on 2 cores)
    # before it even computes a kernel's key. With this machine's store
    # (farm.build.pch) the child's compile and verification take headers from
    # it instead (farm.core.precompiled_headers: torch's way is never
    # reached); without one, torch's way stays off. An operator's
    # TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS is passed on as it is.
    store = pch.child_env()
    operator = os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")
    env = dict(store)
    if operator is not None or not store:
        env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = operator or "0"
    cxx = current_compiler()
    if cxx is not None:
        env["CXX"] = cxx
    # Inductor's ISA test compiles, when this machine's checked pick is known
    # (farm.core.cpu_isa.isa_checks_redundant): 10 g++ runs per build child.
    env.update(isa_check_env())
    return env


class GraphMismatch(Exception):
    """The compile worker's build of the model is not the graph the trace fingerprinted."""


def check_graph(spec: JobSpec, expected: str) -> dict[str, Any]:
    """Trace ``spec`` again where it is about to be compiled and compare the
    fingerprint with the trace stage's: the build key names that graph, so an
    artifact of any other (code that builds differently here: randomness, the
    host, the time) must not be stored under it. Returns what the artifact
    records about its code."""
    import torch

    from farm.build.trace import trace

    report = trace(spec)
    if report.fingerprint != expected:
        raise GraphMismatch(
            f"the compile worker's build of {spec.model.entrypoint} is not the graph the trace "
            f"fingerprinted (here {report.fingerprint[:12]}, traced {expected[:12]}): the "
            "model's code builds a different graph from one process to the next (randomness, "
            "the time, the host, an environment variable), or this worker's torch "
            f"({torch.__version__}) captures it differently from the tracer's; make the "
            "factory deterministic")
    return {"model_class": report.model_class, "code_digest": spec.code_digest,
            "entrypoint": spec.model.entrypoint, "graph_hash": report.graph_hash,
            "graph_checked": True}


def compile_step(payload: dict[str, Any]) -> dict[str, Any]:
    from farm.build import stage_times

    with stage_times.stage(stage_times.IMPORTS):  # torch, Dynamo, Inductor: ~0 when warm
        from farm.build.compile import CHECK_AOTI, compile_artifacts

    spec = JobSpec.from_json(payload["spec"])
    check = None
    if payload.get("fingerprint"):
        from farm.build.graph_check import GraphCheck

        # In a fork beside the compile where one is safe (farm.build.graph_check);
        # its verdict decides before anything is returned.
        with stage_times.stage(stage_times.GRAPH_CHECK):
            check = GraphCheck.start(check_graph, spec, payload["fingerprint"])
    try:
        # The worker answers farm.build.aoti_check outside the sandbox (it is the
        # host's question, and must not spend the model's time limit).
        arts = compile_artifacts(spec, payload["device"], Path(payload["out_dir"]),
                                 aoti_unavailable=payload.get("aoti_unavailable", CHECK_AOTI),
                                 cxx=payload.get("cxx"))
    except BaseException:
        if check is not None:
            # A graph other than the traced one is the reason to give, if it is one.
            check.verdict()
        raise
    code: dict[str, Any] = {}
    if check is not None:
        with stage_times.stage(stage_times.GRAPH_CHECK):  # what is left of it: the wait
            code = check.verdict()
    return {"artifacts": [{"path": str(a.path), "format": a.format, "meta": {**a.meta, **code}}
                          for a in arts]}
