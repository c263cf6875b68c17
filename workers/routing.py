"""Queues and routes, in one place.

``trace`` is consumed by CPU hosts. Each target has its own compile queue,
named after the target's canonical string, consumed only by workers whose own
device and toolchain are that target; a compile task is sent straight to its
target's queue.
"""

from __future__ import annotations

from farm.core.target import Target
from registry.dispatch import COMPILE_TASK, TRACE_QUEUE, TRACE_TASK

__all__ = [
    "COMPILE_TASK", "TASK_ROUTES", "TRACE_QUEUE", "TRACE_TASK", "compile_queue",
]

def compile_queue(target: Target | str) -> str:
    t = Target.parse(target) if isinstance(target, str) else target
    return t.queue


TASK_ROUTES = {
    TRACE_TASK: {"queue": TRACE_QUEUE},
    # COMPILE_TASK is routed per call: apply_async(queue=compile_queue(target)).
}
