"""The farm's own check of a module's weights against what an artifact was built for.

A fake-weight build (``farm.build.fake_weights``) drops Dynamo's TYPE_MATCH and
TENSOR_MATCH guards on parameters and buffers: built against fake tensors, they
would refuse every real module. Those guards were what checked the weights'
shapes, dtypes and devices, so the build records a manifest of the module's
parameters and buffers in the artifact's meta (``weights_manifest``) and the node
compares its own module with it here, before the first call. Pure: a module in,
a reason (or None) out.

Every name of every tensor is an entry (``farm.core.aliases``): a tied weight is
two entries whose ``tensor`` names the first of them, so a node whose module
ties its weights differently from the built one is refused (the compiled
graph reads a tied weight once). Non-persistent buffers (``persistent:
False``) are not in ``state_dict``, and a rotary cache is created at a
module's first call: one present on one side only is no difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from farm.core.aliases import BUFFER, named_tensors

# The artifact meta key of the manifest (a list of ``manifest_entry`` dicts).
MANIFEST_KEY = "weights_manifest"


class WeightsMismatch(RuntimeError):
    """The node's module is not the one the artifact was built for; the message
    names the first difference."""


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def manifest_entry(name: str, kind: str, t: Any, *, tensor: str | None = None,
                   persistent: bool = True) -> dict[str, Any]:
    """What the artifact needs of one name of a parameter or buffer:
    ``tensor`` is the first name of the same tensor (``name`` itself unless
    it is tied to an earlier one); a buffer says whether it is persistent."""
    entry = {
        "name": name,
        "kind": kind,
        "shape": [int(n) for n in t.shape],
        "dtype": _dtype(t),
        "device": t.device.type,
        "requires_grad": bool(t.requires_grad),
        "tensor": tensor if tensor is not None else name,
    }
    if kind == BUFFER:
        entry["persistent"] = bool(persistent)
    return entry


def weights_manifest(module: Any) -> list[dict[str, Any]]:
    """The manifest of ``module``'s parameters and buffers under every name
    (``remove_duplicate=False``), in torch's order."""
    first: dict[int, str] = {}
    return [manifest_entry(t.name, t.kind, t.tensor, tensor=first.setdefault(id(t.tensor), t.name),
                           persistent=t.persistent)
            for t in named_tensors(module)]


def _optional(entry: Mapping[str, Any]) -> bool:
    """A tensor one side may have and the other not: a non-persistent buffer."""
    return entry.get("kind") == BUFFER and entry.get("persistent") is False


def _comparable(expected: Sequence[Mapping[str, Any]],
                actual: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """``actual`` as an older manifest (one entry per tensor, no ``tensor``
    field: before tied weights were recorded) would have had it."""
    if any("tensor" in e for e in expected):
        return actual
    return [e for e in actual if e.get("tensor", e["name"]) == e["name"]]


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def manifest_mismatch(expected: Sequence[Mapping[str, Any]],
                      actual: Sequence[Mapping[str, Any]]) -> str | None:
    """The first difference between the artifact's manifest and the module's,
    as ``"fc1.weight: shape [64,32], artifact built for [128,32]"``; None when
    they agree. Compared by name: a tensor the artifact needs that the module
    lacks, one the module has that the artifact was not built with, then
    each field the dropped guards would have checked, then which names share
    one tensor."""
    actual = _comparable(expected, actual)
    have = {str(e["name"]): e for e in actual}
    want_names = {str(e["name"]) for e in expected}
    for want in expected:
        name = str(want["name"])
        got = have.get(name)
        if got is None:
            if _optional(want):
                continue
            return (f"{name}: the module has no such {want.get('kind', 'tensor')}, the artifact "
                    f"was built for {want.get('dtype')}{_shape(want.get('shape', []))}")
        if got.get("kind") != want.get("kind"):
            return (f"{name}: a {got.get('kind')} in the module, a {want.get('kind')} in the "
                    "artifact")
        if list(got["shape"]) != list(want["shape"]):
            return (f"{name}: shape {_shape(got['shape'])}, artifact built for "
                    f"{_shape(want['shape'])}")
        for key in ("dtype", "device", "requires_grad"):
            if got.get(key) != want.get(key):
                return f"{name}: {key} {got.get(key)}, artifact built for {want.get(key)}"
        if "persistent" in want and "persistent" in got and want["persistent"] != got["persistent"]:
            return (f"{name}: persistent {got['persistent']} (in state_dict: "
                    f"{'yes' if got['persistent'] else 'no'}), artifact built for "
                    f"{want['persistent']}")
        why = _tie_mismatch(name, want, got)
        if why is not None:
            return why
    extra = [e for e in actual if str(e["name"]) not in want_names and not _optional(e)]
    if extra:
        name = str(extra[0]["name"])
        return (f"{name}: the module has this {extra[0].get('kind', 'tensor')}, and "
                "the artifact was built without it")
    return None


def _tie_mismatch(name: str, want: Mapping[str, Any], got: Mapping[str, Any]) -> str | None:
    """Why ``name`` shares its tensor differently in the module than in the
    artifact (None: the same), when both manifests say."""
    if "tensor" not in want or "tensor" not in got or want["tensor"] == got["tensor"]:
        return None
    if want["tensor"] == name:
        return (f"{name}: tied to {got['tensor']} in the module (one tensor), its own tensor in "
                "the artifact")
    if got["tensor"] == name:
        return (f"{name}: its own tensor in the module, tied to {want['tensor']} in the artifact "
                f"(tie them as the built model does: {name} = {want['tensor']})")
    return f"{name}: tied to {got['tensor']} in the module, to {want['tensor']} in the artifact"


def check_weights(module: Any, expected: Sequence[Mapping[str, Any]] | None) -> None:
    """Refuse ``module`` (``WeightsMismatch``) when it differs from the
    artifact's manifest; nothing to check without one (an artifact that
    predates it, or a free function's)."""
    if expected is None or not hasattr(module, "named_parameters"):
        return
    why = manifest_mismatch(expected, weights_manifest(module))
    if why is not None:
        raise WeightsMismatch(f"the module's weights do not fit the artifact: {why}")
