"""Which tasks the broker still holds: for the sweep, which re-sends a queued
job or claim only when its message is lost, not when it merely waits.

A Celery message on Redis (kombu's transport) is in one of two places until
it is acknowledged: the queue's list (waiting), or the ``unacked`` hash
(delivered to a worker, a retry held for its countdown included), from which
kombu restores it to the queue after the visibility timeout. A task found in
neither is lost: the broker restarted without persistence, or the process
that committed its row died before sending it. Other brokers (the embedded
farm's SQLite one) cannot be read this way: there every candidate counts as
lost, as before (a duplicate message is harmless, only wasteful).
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

from farm.core.net import is_redis_url

log = logging.getLogger(__name__)

# kombu's Redis transport: the hash of delivered, unacknowledged messages,
# and the lists a queue's prioritised messages go to (``queue`` for priority
# 0, ``queue\x06\x16N`` for the other default steps).
UNACKED_KEY = "unacked"
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (3, 6, 9)
CHUNK = 1000


def _first_arg(payload: Any) -> str | None:
    """The first argument (a job id or build key) of a kombu message payload."""
    try:
        if isinstance(payload, (bytes, str)):
            payload = json.loads(payload)
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]  # protocol 2: [args, kwargs, embed]
        return str(args[0]) if args else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class BrokerView:
    """What one sweep sees of the broker, read once per queue it asks about."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._redis: Any = None
        self._queued: dict[str, set[str]] = {}
        self._unacked: set[str] | None = None
        self.readable = is_redis_url(broker_url)

    def _client(self) -> Any:
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(
                self.broker_url, socket_timeout=10.0, socket_connect_timeout=5.0
            )
        return self._redis

    def _load_queue(self, queue: str) -> set[str]:
        r = self._client()
        out: set[str] = set()
        for name in (queue, *(f"{queue}{PRIORITY_SEP}{p}" for p in PRIORITY_STEPS)):
            start = 0
            while True:
                chunk = r.lrange(name, start, start + CHUNK - 1)
                out.update(a for a in map(_first_arg, chunk) if a)
                if len(chunk) < CHUNK:
                    break
                start += CHUNK
        return out

    def _load_unacked(self) -> set[str]:
        out: set[str] = set()
        for _, raw in self._client().hscan_iter(UNACKED_KEY, count=CHUNK):
            try:
                message = json.loads(raw)[0]  # [payload, exchange, routing_key]
            except (ValueError, IndexError, TypeError):
                continue
            arg = _first_arg(message)
            if arg:
                out.add(arg)
        return out

    def holds(self, queue: str, first_arg: str) -> bool:
        """True when a message for ``first_arg`` waits in ``queue`` or is
        delivered and unacknowledged; False when it is lost or the broker
        cannot be read (then a re-send is the safe side)."""
        if not self.readable:
            return False
        try:
            if queue not in self._queued:
                self._queued[queue] = self._load_queue(queue)
            if first_arg in self._queued[queue]:
                return True
            if self._unacked is None:
                self._unacked = self._load_unacked()
            return first_arg in self._unacked
        except Exception as exc:  # a broker outage: re-send, as without this view
            log.warning("sweep: cannot read the broker (%s); re-sending what looks lost", exc)
            self.readable = False
            return False
