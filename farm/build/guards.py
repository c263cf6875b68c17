"""Which of Dynamo's guards an aot_compile artifact keeps (``GuardPolicy``,
the job's ``guard_filter``), and the global state it records.

Split out of farm.build.compile, which compiles with them; the bodies are as they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from farm.core.specs import GradMode

# torch's own list (CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES),
# used when this torch does not expose it.
_UNSERIALIZABLE_FALLBACK = (
    "DICT_VERSION",
    "NN_MODULE",
    "ID_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "MODULE_MATCH",
    "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)


def unserializable_guard_types() -> frozenset[str]:
    from torch._dynamo.guards import CheckFunctionManager

    return frozenset(
        getattr(
            CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", _UNSERIALIZABLE_FALLBACK
        )
    )


class GuardPolicy:
    """A ``guard_filter_fn`` that applies the job's policy and records what the
    kept guards pin, for the artifact's metadata."""

    def __init__(self, policy: str, *, drop_prefixes: Sequence[str] = ()) -> None:
        self.policy = policy
        self.unserializable = unserializable_guard_types()
        self.summary: dict[str, Any] = {}
        # Guards on what exists only while the build runs (a regional build's
        # nested_compile_region wrapper around a block class's forward: its
        # closure, which the node's undecorated class does not have, so
        # loading fails evaluating them: "'NoneType' object has no attribute
        # '__closure__'"). Dropped whatever the policy, and listed as dropped.
        self.drop_prefixes = tuple(drop_prefixes)

    def cannot_serialize(self, entry: Any) -> bool:
        if entry.guard_type in self.unserializable:
            return True
        if any(t in self.unserializable for t in entry.derived_guard_types or ()):
            return True
        # TYPE_MATCH on a class torch cannot import by name (defined in a function).
        return bool(getattr(entry.orig_guard, "_unserializable", False))

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        keep = [(self.policy == "keep-all" or not self.cannot_serialize(e))
                and not str(e.name).startswith(self.drop_prefixes) for e in entries]
        self.summary = self._summarise(entries, keep)
        return keep

    def _summarise(self, entries: Sequence[Any], keep: Sequence[bool]) -> dict[str, Any]:
        kept_types: Counter[str] = Counter()
        dropped: list[dict[str, Any]] = []
        tensors: list[dict[str, Any]] = []
        constants: list[dict[str, Any]] = []
        for e, k in zip(entries, keep, strict=True):
            if not k:
                dropped.append(
                    {
                        "type": e.guard_type,
                        "derived": list(e.derived_guard_types or ()),
                        "name": e.name,
                        "global": bool(e.is_global),
                    }
                )
                continue
            kept_types[e.guard_type] += 1
            if e.guard_type == "TENSOR_MATCH" and e.has_value and isinstance(e.value, torch.Tensor):
                t = e.value
                tensors.append(
                    {
                        "name": e.name,
                        "kind": type(t).__name__,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "stride": list(t.stride()),
                        "device": t.device.type,
                        "requires_grad": bool(t.requires_grad),
                    }
                )
            elif e.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH") and e.has_value:
                v = e.value
                if v is None or isinstance(v, (bool, int, float, str)):
                    constants.append({"name": e.name, "value": v})
        return {
            "policy": self.policy,
            "kept": dict(sorted(kept_types.items())),
            "dropped": dropped[:200],
            "dropped_count": len(dropped),
            "tensors": tensors,
            "attributes": constants[:200],
        }


def global_state(grad_mode: GradMode) -> dict[str, Any]:
    """The global state the GLOBAL_STATE guard pins, as the artifact is compiled."""
    return {
        "grad_enabled": grad_mode is GradMode.TRAINING,
        "inference_mode": False,
        "autocast_cpu": False,
        "autocast_cuda": False,
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
