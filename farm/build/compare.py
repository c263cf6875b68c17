"""How a verification compares an artifact's result with eager's: by value,
within the output dtype's tolerance (``Tolerance``: ``|compiled - eager| <=
atol + rtol * max|eager|``), leaf by leaf (``Worst`` keeps each leaf's worst
error), and by structure (containers, pytree specs, a program's own result
types with their attributes), never by identity. ``farm.build.verify``'s
child runs the calls; this judges them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= atol + rtol * max|b|`` elementwise: scaled by the largest
    reference value, so outputs that are all large or all small are judged alike."""

    atol: float
    rtol: float

    def bound(self, ref_max: float) -> float:
        return self.atol + self.rtol * ref_max


# Per output dtype. Inductor fuses and reorders reductions, and for half types
# keeps intermediates in float32 where eager rounds after every op, so low
# precision outputs differ by a few ulps of their largest values.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-7),
    "float32": Tolerance(1e-5, 1e-4),
    "float16": Tolerance(1e-3, 1e-2),
    "bfloat16": Tolerance(1e-2, 3e-2),
}
EXACT = Tolerance(0.0, 0.0)  # integer and bool outputs
# Gradients sum over the batch and run through twice the ops.
GRAD_FACTOR = 4.0


def tolerance_for(dtype: str, override: Tolerance | float | None = None) -> Tolerance:
    if isinstance(override, Tolerance):
        return override
    if isinstance(override, (int, float)):
        return Tolerance(float(override), float(override))
    return TOLERANCES.get(dtype, EXACT)


class Worst:
    """Tracks the comparison closest to (or furthest past) its tolerance, and
    each leaf's worst error over the calls (``leaves``, by path)."""

    def __init__(self) -> None:
        self.err: float | None = None
        self.tol: float | None = None
        self.ratio = -1.0
        self.failures: list[str] = []
        self.leaves: dict[str, dict[str, Any]] = {}

    def add(self, got: Any, ref: Any, override: Any, *, factor: float = 1.0,
            what: str = "output") -> None:
        import torch

        if got.shape != ref.shape or got.dtype != ref.dtype:
            self.failures.append(f"{what}: artifact gave {got.dtype}{list(got.shape)}, "
                                 f"eager {ref.dtype}{list(ref.shape)}")
            return
        dtype = str(ref.dtype).removeprefix("torch.")
        tol = tolerance_for(dtype, override)
        if ref.numel() == 0:
            return
        r = ref.detach().double()
        g = got.detach().double()
        finite = torch.isfinite(r)
        if not torch.equal(finite, torch.isfinite(g)):
            self.failures.append(f"{what}: non-finite values differ from eager's")
            return
        err = float((g - r)[finite].abs().max()) if bool(finite.any()) else 0.0
        bound = tol.bound(float(r[finite].abs().max()) if bool(finite.any()) else 0.0) * factor
        ratio = err / bound if bound > 0 else (0.0 if err == 0 else math.inf)
        if ratio > self.ratio:
            self.err, self.tol, self.ratio = err, bound, ratio
        prev = self.leaves.get(what)
        if prev is None or ratio > prev["_ratio"]:
            self.leaves[what] = {"output": what, "dtype": dtype, "shape": list(ref.shape),
                                 "max_abs_err": err, "tol": bound, "ok": err <= bound,
                                 "_ratio": ratio}
        if err > bound:
            self.failures.append(f"{what}: max abs error {err:.3g} > tolerance {bound:.3g}")

    def finish(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in leaf.items() if k != "_ratio"}
                for leaf in self.leaves.values()]


_SCALARS = (bool, int, float, complex, str, bytes, type(None))
MAX_DEPTH = 32


def compare_tree(got: Any, ref: Any, worst: Worst, override: Any, path: str = "output",
                  depth: int = 0) -> None:
    """Compare by value: tensors within tolerance, everything else by type and
    then by its parts, recursively: builtin containers item by item, pytree
    nodes by treespec and leaves, other objects (a program's own result type)
    by their attributes. Never by identity: the artifact's result is a new
    object of the same type."""
    import torch
    import torch.utils._pytree as pytree

    if depth > MAX_DEPTH:
        worst.failures.append(f"{path}: nested deeper than {MAX_DEPTH}")
        return
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            worst.failures.append(f"{path}: {type(got).__qualname__} where eager gave a tensor")
            return
        worst.add(got, ref, override, what=path)
        return
    if type(got) is not type(ref):
        worst.failures.append(f"{path}: artifact returned {_qual(type(got))}, "
                              f"eager {_qual(type(ref))}")
        return
    if isinstance(ref, _SCALARS):
        if isinstance(ref, float) and isinstance(got, float) and math.isnan(ref):
            if not math.isnan(got):
                worst.failures.append(f"{path}: {got!r} != eager's {ref!r}")
        elif got != ref:
            worst.failures.append(f"{path}: {got!r} != eager's {ref!r}")
        return
    if type(ref) in (tuple, list):
        if len(got) != len(ref):
            worst.failures.append(f"{path}: {len(got)} items, eager {len(ref)}")
            return
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            compare_tree(g, r, worst, override, f"{path}[{i}]", depth + 1)
        return
    if type(ref) is dict:
        if list(got) != list(ref):
            worst.failures.append(f"{path}: keys {list(got)}, eager {list(ref)}")
            return
        for k in ref:
            compare_tree(got[k], ref[k], worst, override, f"{path}[{k!r}]", depth + 1)
        return
    if not pytree.tree_is_leaf(ref):
        g_leaves, g_spec = pytree.tree_flatten(got)
        r_leaves, r_spec = pytree.tree_flatten(ref)
        if g_spec != r_spec:
            worst.failures.append(f"{path}: structure {g_spec} is not eager's {r_spec}")
            return
        for i, (g, r) in enumerate(zip(g_leaves, r_leaves, strict=True)):
            compare_tree(g, r, worst, override, f"{path}.leaf{i}", depth + 1)
        return
    g_attrs, r_attrs = _attributes(got), _attributes(ref)
    if r_attrs is None or g_attrs is None:
        # No attributes to compare (a C type, say): its own equality, which
        # must then be a value equality to pass.
        if got != ref:
            worst.failures.append(f"{path}: {got!r} != eager's {ref!r} "
                                  f"({_qual(type(ref))} has no attributes to compare)")
        return
    if sorted(g_attrs) != sorted(r_attrs):
        worst.failures.append(f"{path}: attributes {sorted(g_attrs)}, eager {sorted(r_attrs)}")
        return
    for name in sorted(r_attrs):
        compare_tree(g_attrs[name], r_attrs[name], worst, override, f"{path}.{name}", depth + 1)


def _attributes(obj: Any) -> dict[str, Any] | None:
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    slots = getattr(type(obj), "__slots__", None)
    if slots is not None:
        names = (slots,) if isinstance(slots, str) else tuple(slots)
        return {n: getattr(obj, n) for n in names if hasattr(obj, n)}
    return None


def _qual(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def non_finite(model: Any) -> str | None:
    """The first floating parameter or buffer holding a NaN or an infinity."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return name
    return None
