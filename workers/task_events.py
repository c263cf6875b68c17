"""Task events that leave the worker when they happen.

Celery buffers a worker's task events (``task-received``, ``task-started``,
...) and sends them from its event loop. A solo worker runs its task inside
that loop, so nothing is sent while a compile runs: Flower would learn that
a build started only once it ended, and never from a worker that died in it
(tests/integration/test_netns.py saw exactly that). This consumer step turns
the buffering off, after every (re)start of the consumer's event dispatcher:
each event is published as it is sent, a few per task.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps


class SendTaskEventsAtOnce(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.events:Events",)

    def start(self, c: Any) -> None:
        dispatcher = getattr(c, "event_dispatcher", None)
        if dispatcher is not None:
            dispatcher.flush()  # anything buffered before this step ran
            dispatcher.buffer_group = frozenset()
