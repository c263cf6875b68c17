"""A fleet node for a factory model called with keyword or dict inputs, run as
a fresh process: build the model (seeded, as the user's node has its own
weights), resolve with named input specs, fetch and verify, load, call with
the keywords and dicts the specs name, compare with eager. Prints one JSON line."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--entrypoint", required=True)
    p.add_argument("--input", action="append", required=True)
    p.add_argument("--pad", type=int, default=0,
                   help="zero the first N positions of attention_mask (left padding)")
    a = p.parse_args()

    import torch
    import torch.utils._pytree as pytree

    from farm.core.inputs import call_args, parse_inputs
    from farm.core.modelref import example_inputs, load_callable
    from farm.core.specs import GradMode
    from farm.core.target import detect_local_target
    from farm.node.client import FarmClient

    specs = parse_inputs(a.input)
    torch.manual_seed(3)
    model = load_callable(a.entrypoint)().eval()
    client = FarmClient()
    resolved = client.resolve(a.model, None, a.input, GradMode.INFERENCE,
                              detect_local_target("cpu"))
    loaded = client.load(resolved, module=model)
    args, kwargs = call_args(specs, example_inputs(specs, device="cpu", seed=5,
                                                   mark_dynamic=False, int_high=128))
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
        kwargs["attention_mask"][:, :a.pad] = 0
    with torch.no_grad():
        out = loaded(*args, **kwargs)
        ref = model(*args, **kwargs)
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    print(json.dumps({
        "format": resolved["artifact"]["format"],
        "inputs": resolved["artifact"]["inputs"],
        "type": f"{type(out).__module__}.{type(out).__qualname__}",
        "eager_type": f"{type(ref).__module__}.{type(ref).__qualname__}",
        "keys": list(out.keys()) if hasattr(out, "keys") else None,
        "leaves": len(got),
        "max_abs_err": max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)),
    }))


if __name__ == "__main__":
    main()
