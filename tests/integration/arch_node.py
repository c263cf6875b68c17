"""A fleet node for one row of the architectures matrix, run as a fresh
process: build the row's model as its user does (the library's own init and
weight tying, seeded), resolve the farm's artifact of the asked format for
this machine, fetch and verify it, load it against that module, call it and
compare with eager. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time

T0 = time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--arch", required=True)
    p.add_argument("--format", required=True)
    a = p.parse_args()

    import torch

    from farm.core.inputs import parse_inputs
    from farm.core.modelref import example_inputs
    from farm.core.specs import GradMode
    from farm.core.target import detect_local_target
    from farm.node.client import FarmClient
    from farm.node.loader import load_artifact
    from tests.models.archs import BY_NAME, build

    row = BY_NAME[a.arch]
    specs = parse_inputs(list(row.inputs))
    torch.manual_seed(7)  # the node's own weights: not the builder's, not the verifier's
    model = build(a.arch).eval()
    client = FarmClient()
    resolved = client.resolve(
        a.model,
        None,
        [str(s) for s in specs],
        GradMode.INFERENCE,
        detect_local_target("cpu"),
        formats=[a.format],
    )
    art = resolved["artifact"]
    path, verified = client.fetch_verified(resolved)
    # The signed build statement's weights manifest is what load_artifact
    # checks the module against (tied weights included) before loading.
    fn = load_artifact(path, art["format"], module=model, attestation=verified)
    xs = example_inputs(specs, device="cpu", seed=11, mark_dynamic=False)
    with torch.no_grad():
        got = fn(*xs)
        want = model(*xs)
    names = list(model.named_parameters(remove_duplicate=False))
    print(
        json.dumps(
            {
                "format": art["format"],
                "digest": art["digest"],
                "shape": list(got.shape),
                "max_abs_err": float((got - want).abs().max()),
                "ref_max": float(want.abs().max()),
                "tied_names": len(names) - len(list(model.named_parameters())),
                "seconds": round(time.monotonic() - T0, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
