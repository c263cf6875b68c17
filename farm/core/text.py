"""Text helpers shared by every part: one line of an error for a message."""

from __future__ import annotations


def first_line(value: object, default: str | None = None) -> str:
    """The first line of ``str(value)``, stripped. With no text: ``default``
    if given, else the type's name for an exception (``TimeoutError()`` says
    nothing by itself) and "" for anything else."""
    lines = str(value).strip().splitlines()
    if lines:
        return lines[0]
    if default is not None:
        return default
    return type(value).__name__ if isinstance(value, BaseException) else ""


def human_bytes(n: int | None, *, missing: str = "?") -> str:
    """``n`` bytes as people read them (``166.3 KB``); ``missing`` when unknown."""
    if n is None:
        return missing
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
