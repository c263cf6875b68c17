"""The workers table's arithmetic (registry.api.worker_stats), from rows as
the database and the broker give them."""

from __future__ import annotations

from farm.core.target import Target
from registry.api.worker_stats import queue_names, worker_table

CPU = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"
GONE = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2"

ROWS = [
    {"target": CPU, "state": "succeeded", "builds": 3, "compile_s": 30.0, "timed": 3},
    {"target": CPU, "state": "failed", "builds": 2, "compile_s": 0.0, "timed": 0},
    {"target": CPU, "state": "running", "builds": 1, "compile_s": 0.0, "timed": 0},
    {"target": GONE, "state": "queued", "builds": 4, "compile_s": 0.0, "timed": 0},
    {"target": "not a target", "state": "failed", "builds": 1, "compile_s": 0.0, "timed": 0},
]
WORKERS = [
    {"id": "a:1", "kind": "compile", "queue": Target.parse(CPU).queue, "target": CPU},
    {"id": "b:2", "kind": "compile", "queue": Target.parse(CPU).queue, "target": CPU},
    {"id": "t:3", "kind": "trace", "queue": "trace", "target": None},
]


def test_rows_per_target_with_depths_and_workers() -> None:
    depths = {"trace": 5, Target.parse(CPU).queue: 2, Target.parse(GONE).queue: 4}
    table = worker_table(ROWS, WORKERS, depths)
    by = {t.target: t for t in table.targets}
    cpu, gone, odd = by[CPU], by[GONE], by["not a target"]
    assert (cpu.workers, cpu.queued, cpu.failed, cpu.timed) == (2, 2, 2, 3)
    assert cpu.mean_compile_s == 10.0 and cpu.builds["running"] == 1
    # A target nobody serves still shows its backlog.
    assert (gone.workers, gone.queued, gone.mean_compile_s) == (0, 4, None)
    # A row whose target does not parse has no queue to read.
    assert odd.queue is None and odd.queued is None and odd.failed == 1
    assert table.trace_queued == 5 and table.broker_error is None


def test_without_the_broker_the_depths_are_unknown_not_zero() -> None:
    table = worker_table(ROWS, WORKERS, None, broker_error="the broker cannot be read: x")
    assert all(t.queued is None for t in table.targets)
    assert table.trace_queued is None and table.broker_error


def test_queues_read_include_targets_without_live_workers() -> None:
    names = queue_names(ROWS, WORKERS)
    assert names == {Target.parse(CPU).queue: CPU, Target.parse(GONE).queue: GONE}
