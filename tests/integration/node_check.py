"""A fleet node, run as a fresh process by the integration tests.

Resolves the farm's artifact for this machine, fetches and verifies it
through the client, loads it against a real module (seeded random weights,
the same in every process), and compares with eager. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--ref")
    p.add_argument("--entrypoint", required=True)
    p.add_argument("--kwargs", default="{}")
    p.add_argument("--input", action="append", required=True)
    p.add_argument("--format")
    p.add_argument("--train", action="store_true")
    a = p.parse_args()

    import torch

    from farm.core.inputs import parse_inputs
    from farm.core.modelref import build_module
    from farm.core.specs import GradMode, ModelRef
    from farm.core.target import detect_local_target
    from farm.node.client import FarmClient
    from farm.node.loader import load_artifact

    specs = parse_inputs(a.input)
    grad = GradMode.TRAINING if a.train else GradMode.INFERENCE
    client = FarmClient()
    resolved = client.resolve(a.model, a.ref, [str(s) for s in specs], grad,
                              detect_local_target("cpu"),
                              formats=[a.format] if a.format else None)
    art = resolved["artifact"]
    path, verified = client.fetch_verified(resolved)
    module = build_module(ModelRef(a.entrypoint, json.loads(a.kwargs)), device="cpu", seed=0)
    module.train(a.train)
    fn = load_artifact(path, art["format"], module=module, attestation=verified)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in specs]
    result: dict[str, object] = {"format": art["format"], "digest": art["digest"]}
    if a.train:
        out = fn(*xs)
        out.sum().backward()
        got_grads = [q.grad.clone() for q in module.parameters()]
        module.zero_grad(set_to_none=True)
        ref = module(*xs)
        ref.sum().backward()
        ref_grads = [q.grad for q in module.parameters()]
        result["max_grad_err"] = max(
            float((g - r).abs().max()) for g, r in zip(got_grads, ref_grads, strict=True)
        )
    else:
        with torch.no_grad():
            out = fn(*xs)
            ref = module(*xs)
    result["max_abs_err"] = float((out.detach() - ref.detach()).abs().max())
    result["seconds"] = time.monotonic() - T0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
