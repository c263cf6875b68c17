"""Text helpers shared by every part: one line of an error for a message."""

from __future__ import annotations

import re


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


# torch's repr of a fake tensor, as Dynamo's errors quote every argument of
# the op that failed: ``FakeTensor(..., device='meta', size=(8, 63))``, a
# parameter ``Parameter(FakeTensor(..., size=(128, 64), requires_grad=True))``.
_FAKE_TENSOR = re.compile(
    r"(?P<param>Parameter\()?FakeTensor\(\.\.\.(?P<fields>(?:,\s*\w+=(?:\([^()]*\)|'[^']*'"
    r"|[^,()]+))*)\)(?(param)\))"
)
_FIELD = re.compile(r"(\w+)=(\([^()]*\)|'[^']*'|[^,()]+)")


def _tensor_text(m: re.Match[str]) -> str:
    fields = dict(_FIELD.findall(m.group("fields")))
    dtype = fields.get("dtype", "torch.float32").strip().removeprefix("torch.")
    size = fields.get("size", "()").strip().strip("()").replace(" ", "").rstrip(",")
    device = fields.get("device", "'cpu'").strip().strip("'")
    # Written as the farm's input specs are (float32[8,63]); the trace's own
    # meta device says nothing to the user, another device does.
    text = f"{dtype}[{size}]" + (f" on {device}" if device not in ("meta", "cpu") else "")
    return f"param {text}" if m.group("param") else text


def readable_tensors(text: str) -> str:
    """``text`` with each fake tensor's repr as its dtype and shape
    (``float32[8,63]``, ``param float32[128,64]``): what failed and on what,
    without the repr of every argument the op had."""
    return _FAKE_TENSOR.sub(_tensor_text, text)
