"""Errors and small helpers every part of the state machine shares."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

log = logging.getLogger(__name__)


TERMINAL_BUILD_STATES = frozenset({"succeeded", "reused", "failed"})
LOG_LIMIT = 64_000  # characters of a log or traceback kept in SQL


class NotFound(LookupError):
    """The named model, version, alias, job or artifact does not exist."""


class InvalidRequest(ValueError):
    """A request that is well-formed but cannot be served; the message says why."""


class Clash(ValueError):
    """A name that would shadow another (a version named like an alias of its
    model, an alias like a version): refused with 409; the message says which."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= LOG_LIMIT:
        return text
    # Keep the end: the traceback's last frames and the error are what matter.
    return "[... clipped ...]\n" + text[-LOG_LIMIT:]
