"""Where one build's seconds went, for its log and its job page.

Accounts kept apart, because only the first is the worker's own:

- ``worker``: what the compile task timed itself (fetching the code,
  prefilling the compile cache, the compile child's wall time, verifying and
  storing each format, sharing the cache);
- ``child``: the compile child's own split of its wall time
  (``farm.build.stage_times``: its start, imports, the graph check, Dynamo,
  AOTAutograd, Inductor's lowering and codegen, kernel builds, saving, the
  warm-up), as far as the worker's range checks let it through. A child can
  misreport its own seconds; nothing the worker decides depends on them;
- ``zygote``: when the build's compile child or its verification child was
  its zygote's first, the zygotes' own split of the worker's "build zygote
  start" seconds (``farm.build.zygote``; both added up where both waited),
  kept as far as those seconds allow.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from farm.build.stage_times import describe

COMPILE_CHILD = "compile child"
# Waiting for the build zygote's start (farm.build.zygote): a worker's first build.
ZYGOTE_START = "build zygote start"


@dataclass
class BuildTimings:
    worker: dict[str, float] = field(default_factory=dict)
    child: dict[str, float] = field(default_factory=dict)
    # The compile child forked from a warm zygote (None: no child ran).
    warm: bool | None = None
    # The build zygote's start, when this build's child was its first:
    # the zygote's own split of the worker's "build zygote start" seconds.
    zygote: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.worker[name] = round(self.worker.get(name, 0.0) + max(0.0, seconds), 3)

    def child_ran(self, wall_s: float, stages: dict[str, float], *, warm: bool,
                  zygote_start: dict[str, float] | None = None) -> None:
        """The compile child's wall time and its own stages; ``zygote_start``
        (``SandboxResult.zygote_start``) when it waited for its zygote's
        start, which is this worker's first build of its kind."""
        start = dict(zygote_start or {})
        if "total" in start:
            self.add(ZYGOTE_START, start.pop("total"))
            self._add_zygote_split(start)
        self.add(COMPILE_CHILD, wall_s)
        self.child = dict(stages)
        self.warm = warm

    def zygote_started_during(self, stage: str, zygote_start: dict[str, float]) -> None:
        """A worker stage (a verification) whose child waited for its own
        zygote's start (``SandboxResult.zygote_start``; a CPU AOTI package's
        verifier has a zygote of its own, with no compiler on its path):
        those seconds move from ``stage`` to "build zygote start", and the
        zygote's split is added to any earlier start's."""
        start = dict(zygote_start)
        total = min(max(0.0, start.pop("total", 0.0)), self.worker.get(stage, 0.0))
        if not total:
            return
        self.worker[stage] = round(self.worker[stage] - total, 3)
        self.add(ZYGOTE_START, total)
        self._add_zygote_split(start)

    def _add_zygote_split(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.zygote[name] = round(self.zygote.get(name, 0.0) + seconds, 3)

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "child": self.child, "warm": self.warm,
                "zygote": self.zygote}

    def log_lines(self) -> list[str]:
        lines = [f"seconds, worker: {describe(self.worker)}"] if self.worker else []
        if self.zygote:
            lines.append("seconds, build zygote start (once per worker process and kind; "
                         f"its own account): {describe(self.zygote)}")
        if self.child:
            how = "forked warm" if self.warm else "a new interpreter"
            lines.append(f"seconds, compile child ({how}; its own account): {describe(self.child)}")
        return lines
