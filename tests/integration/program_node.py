"""A fleet node for a free-function program, run as a fresh process: resolve
with the requested options, fetch and verify, load with the function (its
module's globals rebuild the program's own result type), call, compare with
eager. Prints one JSON line."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--ref", default=None)
    p.add_argument("--entrypoint", required=True)
    p.add_argument("--input", action="append", required=True)
    p.add_argument("--options", default=None, help="JSON object of compile options to ask for")
    p.add_argument("--external-data", action="append", default=[],
                   help="a global of the function's module to pass as external_data")
    p.add_argument("--call-shape", default=None,
                   help="call with inputs of this shape (comma-separated) instead")
    a = p.parse_args()

    import torch

    from farm.core.inputs import parse_inputs
    from farm.core.modelref import load_callable
    from farm.core.specs import GradMode
    from farm.core.target import detect_local_target
    from farm.node.client import FarmClient

    specs = parse_inputs(a.input)
    client = FarmClient()
    resolved = client.resolve(a.model, a.ref, [str(s) for s in specs], GradMode.INFERENCE,
                              detect_local_target("cpu"),
                              options=json.loads(a.options) if a.options else None)
    art = resolved["artifact"]
    fn = load_callable(a.entrypoint)
    external = {n: fn.__globals__[n] for n in a.external_data}
    loaded = client.load(resolved, module=fn, external_data=external or None)
    gen = torch.Generator().manual_seed(1)
    shape = (tuple(int(n) for n in a.call_shape.split(",")) if a.call_shape else None)
    xs = [torch.randn(shape or s.shape, generator=gen) for s in specs]
    result: dict[str, object] = {"format": art["format"], "digest": art["digest"],
                                 "options": art["options"], "why": resolved.get("why")}
    try:
        with torch.no_grad():
            out = loaded(*xs)
            ref = fn(*xs)
    except Exception as exc:
        result["call_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        print(json.dumps(result))
        return
    result["type"] = f"{type(out).__module__}.{type(out).__qualname__}"
    result["eager_type"] = f"{type(ref).__module__}.{type(ref).__qualname__}"
    got = out.value if hasattr(out, "value") else out
    want = ref.value if hasattr(ref, "value") else ref
    result["max_abs_err"] = float((got - want).abs().max())
    result["attrs"] = sorted(vars(out)) if hasattr(out, "__dict__") else []
    print(json.dumps(result))


if __name__ == "__main__":
    main()
