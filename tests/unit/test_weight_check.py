"""The farm's own weight check (farm.node.weight_check): pure, on manifests and
small modules; and the guard filter of fake-weight builds, on guard-shaped records."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from farm.build.fake_weights import is_weight_guard
from farm.core.specs import CompileOptions, GradMode, JobSpec, SpecError
from farm.node.weight_check import (
    MANIFEST_KEY,
    WeightsMismatch,
    check_weights,
    manifest_mismatch,
    weights_manifest,
)


class Net(nn.Module):
    def __init__(self, hidden: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, 32, dtype=dtype)
        self.register_buffer("scale", torch.ones(32, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def test_manifest_names_every_parameter_and_buffer_with_what_guards_checked() -> None:
    m = weights_manifest(Net())
    assert [(e["name"], e["kind"]) for e in m] == [
        ("fc1.weight", "parameter"), ("fc1.bias", "parameter"), ("fc2.weight", "parameter"),
        ("fc2.bias", "parameter"), ("scale", "buffer")]
    assert m[0] == {"name": "fc1.weight", "kind": "parameter", "shape": [64, 32],
                    "dtype": "float32", "device": "cpu", "requires_grad": True,
                    "tensor": "fc1.weight"}
    assert m[-1]["persistent"] is True


def test_the_same_module_fits_and_one_built_on_meta_does_too() -> None:
    built = weights_manifest(Net())
    with torch.device("meta"):
        meta = Net()
    meta.to_empty(device="cpu")
    assert manifest_mismatch(built, weights_manifest(meta)) is None
    check_weights(Net(), built)  # no raise


def test_a_wrong_shape_is_named_with_both_shapes() -> None:
    why = manifest_mismatch(weights_manifest(Net(hidden=128)), weights_manifest(Net(hidden=64)))
    assert why == "fc1.weight: shape [64,32], artifact built for [128,32]"


@pytest.mark.parametrize(("change", "expected"), [
    (lambda n: n.to(torch.float64), "fc1.weight: dtype float64, artifact built for float32"),
    (lambda n: n.requires_grad_(False),
     "fc1.weight: requires_grad False, artifact built for True"),
    (lambda n: n.to("meta"), "fc1.weight: device meta, artifact built for cpu"),
])
def test_dtype_requires_grad_and_device_are_checked(change, expected) -> None:  # type: ignore[no-untyped-def]
    net = Net()
    change(net)
    assert manifest_mismatch(weights_manifest(Net()), weights_manifest(net)) == expected


def test_missing_and_extra_tensors_are_refused() -> None:
    want = weights_manifest(Net())
    net = Net()
    del net.scale
    assert manifest_mismatch(want, weights_manifest(net)) == (
        "scale: the module has no such buffer, the artifact was built for float32[32]")
    net = Net()
    net.extra = nn.Parameter(torch.zeros(3))
    assert manifest_mismatch(want, weights_manifest(net)) == (
        "extra: the module has this parameter, and the artifact was built without it")


def test_a_buffer_where_a_parameter_was_is_refused() -> None:
    want = weights_manifest(Net())
    net = Net()
    w = net.fc1.bias.detach().clone()
    del net.fc1.bias
    net.fc1.register_buffer("bias", w)
    why = manifest_mismatch(want, weights_manifest(net))
    assert why is not None and why.startswith("fc1.bias: ")


def test_check_weights_raises_with_the_reason_and_skips_without_a_manifest() -> None:
    with pytest.raises(WeightsMismatch, match=r"fc1\.weight: shape \[64,32\], artifact built "
                                              r"for \[128,32\]"):
        check_weights(Net(hidden=64), weights_manifest(Net(hidden=128)))
    check_weights(Net(hidden=64), None)  # an artifact that predates the manifest
    check_weights(lambda x: x, weights_manifest(Net()))  # a free function has no weights


def _guard(kind: str, name: str) -> SimpleNamespace:
    return SimpleNamespace(guard_type=kind, name=name)


def test_weight_guards_are_those_on_one_parameter_or_buffer() -> None:
    assert is_weight_guard(_guard("TENSOR_MATCH", "module._modules['fc1']._parameters['weight']"))
    assert is_weight_guard(_guard("TYPE_MATCH", "module._buffers['scale']"))
    # The dicts that hold them keep their type guards; inputs keep theirs.
    assert not is_weight_guard(_guard("TYPE_MATCH", "module._parameters"))
    assert not is_weight_guard(_guard("TENSOR_MATCH", "L['inputs'][0]"))
    # Other guards on a weight (say its identity) are not this filter's business.
    assert not is_weight_guard(_guard("ID_MATCH", "module._modules['fc1']._parameters['weight']"))


def test_weights_option_enters_the_options_text_only_when_set() -> None:
    assert CompileOptions().canonical() == CompileOptions.from_json({}).canonical()
    assert "weights" not in CompileOptions().to_json()
    fake = CompileOptions.from_json({"weights": "fake"})
    assert fake.weights == "fake" and fake.to_json()["weights"] == "fake"
    assert CompileOptions.from_json(fake.to_json()) == fake
    with pytest.raises(SpecError, match="unknown weights 'real'"):
        CompileOptions.from_json({"weights": "real"})


def _verified(path: Path, manifest: list[dict[str, Any]] | None) -> Any:
    from farm.core.digests import sha256_file
    from farm.core.target import detect_local_target
    from farm.node.verify import NodeRequest, Verified

    request = NodeRequest(model="m", ref=None, inputs=(), grad_mode=GradMode.INFERENCE,
                          target=detect_local_target("cpu", check_compiler=False))
    return Verified(digest=sha256_file(path), size=path.stat().st_size, format="aot_compile",
                    build_key="0" * 64, model="m", version="1", alias=None, alias_issued_at=None,
                    builder_keyid="k", trust_list_version=1, request=request,
                    build={} if manifest is None else {MANIFEST_KEY: manifest})


def test_the_signed_manifest_wins_over_the_farms_unsigned_answer(tmp_path: Path) -> None:
    from farm.node.loader import load_artifact

    blob = tmp_path / "a.bin"
    blob.write_bytes(b"never unpickled: the check refuses first")
    signed = weights_manifest(Net(hidden=128))
    # The answer's meta claims the node's own shapes; the build statement says 128.
    with pytest.raises(WeightsMismatch, match=r"shape \[64,32\], artifact built for \[128,32\]"):
        load_artifact(blob, "aot_compile", module=Net(hidden=64),
                      attestation=_verified(blob, signed),
                      weights_manifest=weights_manifest(Net(hidden=64)))


def test_the_build_statement_carries_the_manifest_only_when_there_is_one() -> None:
    from farm.build.provenance import build_statement
    from farm.core.target import detect_local_target

    spec = JobSpec.from_json({"name": "m", "version": "1",
                              "model": {"entrypoint": "farm.zoo.basic:mlp"},
                              "inputs": ["float32[4,64]"]})
    common = {"digest": "a" * 64, "size": 1, "fmt": "aot_compile", "build_key": "b" * 64,
              "fingerprint": "c" * 64, "spec": spec,
              "target": detect_local_target("cpu", check_compiler=False),
              "builder_id": "w", "builder_keyid": "k", "built_at": "2026-12-01T00:00:00Z"}
    manifest = weights_manifest(Net())
    with_it = build_statement(**common, meta={MANIFEST_KEY: manifest})
    without = build_statement(**common, meta={})
    assert with_it["predicate"][MANIFEST_KEY] == manifest
    assert MANIFEST_KEY not in without["predicate"]


def test_a_node_whose_weights_differ_falls_back_to_jit_saying_why(tmp_path: Path) -> None:
    import concurrent.futures

    from farm.core.target import detect_local_target
    from farm.node.compiled import CompiledHandle, Prefetched

    blob = tmp_path / "a.bin"
    blob.write_bytes(b"never unpickled: the check refuses first")
    target = detect_local_target("cpu", check_compiler=False)
    pre = Prefetched(model="m", ref=None, version="1", inputs=(), grad_mode=GradMode.INFERENCE,
                     target=target, path=blob, timings={}, verified=None,
                     artifact={"digest": "ab" * 32, "format": "aot_compile",
                               "meta": {MANIFEST_KEY: weights_manifest(Net(hidden=128))}})
    reports: list[dict[str, Any]] = []

    class Client:
        def report(self, kind: str, **kw: Any) -> None:
            reports.append({"kind": kind, **kw})

    handle = CompiledHandle.__new__(CompiledHandle)
    handle._future = concurrent.futures.Future()
    handle._future.set_result(pre)
    handle.__dict__.update(_import_thread=None, timings={}, _client=Client(), model="m",
                           ref=None, inputs=(), grad_mode=GradMode.INFERENCE, target=target)
    fast = handle.bind(Net(hidden=64))
    assert fast.source == "jit"  # type: ignore[attr-defined]
    assert fast.reason == (  # type: ignore[attr-defined]
        "artifact abababababab (aot_compile) refused: the module's weights do not fit the "
        "artifact: fc1.weight: shape [64,32], artifact built for [128,32]")
    assert [(r["kind"], r["code"]) for r in reports] == [("fallback", "weights_mismatch")]
    with pytest.raises(WeightsMismatch):
        handle.bind(Net(hidden=64), fallback=False)
