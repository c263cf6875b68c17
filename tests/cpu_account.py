"""Where the suite's CPU goes: each test's CPU seconds, its own and those of
every process it started (farms, workers, zygotes, build children, g++),
measured by the kernel.

An opt-in pytest plugin. Each pytest process (each xdist worker) moves
itself into a cgroup of its own (cgroup v1's ``cpuacct`` controller, which
needs root), so everything it starts is counted there, wherever in the
process tree it ends up; ``getrusage`` cannot do that, since a farm's
processes are not all children of the test that drives them. A test's
seconds are the group's usage from its setup to its teardown: a module
fixture's farm start counts to the module's first test, and a session
farm's background work to whichever test runs beside it.

    bash scripts/test.sh -p tests.cpu_account          # writes $SUITE_CPU_OUT
    .venv/bin/python -m tests.cpu_account [FILE]       # CPU seconds by module

``SUITE_CPU_OUT`` defaults to ``/tmp/suite-cpu.jsonl`` (one line a test,
appended). Where there is no writable cpuacct hierarchy the plugin says so
once and records nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct/torch-farm-tests")
OUT = os.environ.get("SUITE_CPU_OUT", "/tmp/suite-cpu.jsonl")
_group: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    group = ROOT / os.environ.get("PYTEST_XDIST_WORKER", "main")
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        warnings.warn(f"tests.cpu_account: no cpuacct cgroup ({exc}); nothing recorded",
                      stacklevel=1)
        return
    _group.append(group)


def _usage_s() -> float:
    return int((_group[0] / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _group:
        yield
        return
    cpu0, t0 = _usage_s(), time.time()
    yield
    line = {"worker": _group[0].name, "test": item.nodeid, "cpu_s": round(_usage_s() - cpu0, 3),
            "wall_s": round(time.time() - t0, 3)}
    with open(OUT, "a") as f:
        f.write(json.dumps(line) + "\n")


def report(path: str) -> str:
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for raw in Path(path).read_text().splitlines():
        r = json.loads(raw)
        m = by_module[r["test"].split("::")[0]]
        m[0] += r["cpu_s"]
        m[1] += r["wall_s"]
        m[2] += 1
    total = sum(m[0] for m in by_module.values())
    lines = [f"{total:.0f} CPU-s in {sum(int(m[2]) for m in by_module.values())} tests",
             "   CPU-s   wall-s  tests  module"]
    for name, (cpu, wall, n) in sorted(by_module.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:8.1f} {wall:8.1f} {int(n):6d}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else OUT))
