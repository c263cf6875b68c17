"""What the fleet client raises: one base class, with the HTTP status and the
farm's detail kept for callers that want to branch on them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class FarmError(Exception):
    """Anything the farm or the path to it refused; ``str()`` is one clear line."""

    def __init__(self, message: str, *, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class FarmUnavailable(FarmError):
    """The farm could not be reached, or answered 5xx."""


class AuthenticationError(FarmError):
    """401 or 403: no token, a wrong one, or one without the role needed."""


class NotFoundError(FarmError):
    """404. For a resolve, ``rejections`` lists each candidate and why it was refused."""

    def __init__(self, message: str, *, status: int | None = 404, detail: Any = None,
                 rejections: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(message, status=status, detail=detail)
        self.rejections = [dict(r) for r in rejections]


class IntegrityError(FarmError):
    """Downloaded bytes or their signature do not verify: never loaded."""


class JobTimeout(FarmError):
    """``wait`` gave up before the job finished."""


# --- small helpers -------------------------------------------------------------


def _detail_text(detail: Any) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        # FastAPI's validation errors.
        parts = []
        for e in detail:
            if isinstance(e, Mapping):
                loc = ".".join(str(p) for p in e.get("loc", ()))
                parts.append(f"{loc}: {e.get('msg', e)}" if loc else str(e.get("msg", e)))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


def format_rejections(rejections: Sequence[Mapping[str, Any]], *, limit: int = 10) -> str:
    """One line per rejected candidate, for logs and the CLI."""
    lines = []
    for r in rejections[:limit]:
        digest = str(r.get("digest") or "")[:12]
        where = f" [{r['target']}]" if r.get("target") else ""
        lines.append(f"  {digest or '?'} {r.get('format', '')}{where}: "
                     f"{r.get('reason') or r.get('code') or r}")
    if len(rejections) > limit:
        lines.append(f"  ... and {len(rejections) - limit} more")
    return "\n".join(lines)


