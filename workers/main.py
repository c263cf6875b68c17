"""`farm worker trace|compile`: start a Celery worker on the right queue."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def run_worker(
    kind: str,
    *,
    device: str | None = None,
    concurrency: int = 1,
    loglevel: str = "INFO",
    hostname: str | None = None,
) -> None:
    from farm.build.isolation import SandboxUnavailable
    from farm.build.sandbox import check_worker_can_isolate
    from farm.core.target import detect_local_target
    from workers import lifecycle
    from workers.app import app
    from workers.routing import TRACE_QUEUE

    try:
        # Both kinds run model code (the trace imports and builds it).
        check_worker_can_isolate()
    except SandboxUnavailable as exc:
        raise SystemExit(f"farm worker {kind}: {exc}") from None
    # Compiled bytecode for the build children, where this machine's Python
    # keeps none (farm.build.bytecode): once per machine, beside the first builds.
    from farm.build.bytecode import fill_in_background as fill_bytecode

    fill_bytecode()
    if kind == "trace":
        queue, target = TRACE_QUEUE, None
    elif kind == "compile":
        t = detect_local_target(device)
        queue, target = t.queue, str(t)
        print(f"compile worker for target {t}", flush=True)
        # Before taking work: the first time on a machine this builds and
        # loads a tiny AOTI package (seconds to a minute), which would
        # otherwise run beside the first build and eat into its limits.
        from farm.build.aoti_check import aoti_loads_here
        from workers.context import settings
        from workers.tasks import AOTI_OFF

        builds_aoti = settings().farm_aoti
        if builds_aoti:
            ok, why = aoti_loads_here(t.device)
            builds_aoti = ok
            print(f"AOTI packages built here {'load' if ok else 'do not load'} ({why})",
                  flush=True)
        else:
            print(AOTI_OFF, flush=True)
        # This machine's precompiled C++ headers, once per toolchain, beside
        # the first builds (which compile without them until they are there).
        # The sample AOTI package (a third of the fill) only where this
        # worker builds CPU packages: AOTI's headers serve those alone.
        from farm.build.pch import fill_in_background, wants_aoti_sample

        fill_in_background(aoti=wants_aoti_sample(t.device, builds_aoti))
    else:
        raise SystemExit(f"unknown worker kind {kind!r}; known: trace, compile")
    lifecycle.configure(kind=kind, queue=queue, target=target)
    # Solo pool: the work runs in sandbox children anyway, and a solo worker
    # killed with -9 takes nothing else down with it.
    argv = [
        "worker",
        "-Q",
        queue,
        "--pool",
        "solo" if concurrency == 1 else "threads",
        "--concurrency",
        str(concurrency),
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]
    argv += ["--hostname", hostname or f"{kind}@%h-{os.getpid()}"]
    app.worker_main(argv)
