"""The farm's own check of a module's weights against what an artifact was built for.

A fake-weight build (``farm.build.fake_weights``) drops Dynamo's TYPE_MATCH and
TENSOR_MATCH guards on parameters and buffers: built against fake tensors, they
would refuse every real module. Those guards were what checked the weights'
shapes, dtypes and devices, so the build records a manifest of the module's
parameters and buffers in the artifact's meta (``weights_manifest``) and the node
compares its own module with it here, before the first call. Pure: a module in,
a reason (or None) out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The artifact meta key of the manifest (a list of ``manifest_entry`` dicts).
MANIFEST_KEY = "weights_manifest"


class WeightsMismatch(RuntimeError):
    """The node's module is not the one the artifact was built for; the message
    names the first difference."""


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def manifest_entry(name: str, kind: str, t: Any) -> dict[str, Any]:
    """What the artifact needs of one parameter or buffer."""
    return {
        "name": name,
        "kind": kind,
        "shape": [int(n) for n in t.shape],
        "dtype": _dtype(t),
        "device": t.device.type,
        "requires_grad": bool(t.requires_grad),
    }


def named_weights(module: Any) -> Iterable[tuple[str, str, Any]]:
    """(name, kind, tensor) of every parameter and buffer (shared ones once)."""
    for name, p in module.named_parameters():
        yield name, "parameter", p
    for name, b in module.named_buffers():
        yield name, "buffer", b


def weights_manifest(module: Any) -> list[dict[str, Any]]:
    """The manifest of ``module``'s parameters and buffers, in its own order."""
    return [manifest_entry(name, kind, t) for name, kind, t in named_weights(module)]


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def manifest_mismatch(expected: Sequence[Mapping[str, Any]],
                      actual: Sequence[Mapping[str, Any]]) -> str | None:
    """The first difference between the artifact's manifest and the module's,
    as ``"fc1.weight: shape [64,32], artifact built for [128,32]"``; None when
    they agree. Compared by name: a tensor the artifact needs that the module
    lacks, one the module has that the artifact was not built with, then
    each field the dropped guards would have checked."""
    have = {str(e["name"]): e for e in actual}
    want_names = {str(e["name"]) for e in expected}
    for want in expected:
        name = str(want["name"])
        got = have.get(name)
        if got is None:
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
    extra = [str(e["name"]) for e in actual if str(e["name"]) not in want_names]
    if extra:
        return (f"{extra[0]}: the module has this {have[extra[0]].get('kind', 'tensor')}, and "
                "the artifact was built without it")
    return None


def check_weights(module: Any, expected: Sequence[Mapping[str, Any]] | None) -> None:
    """Refuse ``module`` (``WeightsMismatch``) when it differs from the
    artifact's manifest; nothing to check without one (an artifact that
    predates it, or a free function's)."""
    if expected is None or not hasattr(module, "named_parameters"):
        return
    why = manifest_mismatch(expected, weights_manifest(module))
    if why is not None:
        raise WeightsMismatch(f"the module's weights do not fit the artifact: {why}")
