"""Per-block compilation's parts: the payload's format, the blocks' keys,
the serving of each block at its first call, and the reuse of compiled blocks within
a build and from the compile cache (backend eager: Dynamo's guards and
torch's save/load are real, no kernels are compiled)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from farm.build.blocks import BlocksUnavailable, block_key, compile_blocks
from farm.core.specs import CompileOptions, SpecError
from farm.node.blocks import (
    BlocksFormatError,
    BlockwiseModel,
    call_block,
    is_blocks,
    pack,
    unpack,
)
from farm.zoo.stack import stack

CONTEXT = {"torch": torch.__version__, "options": "eager"}


def compile_one(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return torch.compile(call_block, fullgraph=True, backend="eager").aot_compile(
        ((block, *args), kwargs))


def load_one(data: bytes) -> Any:
    return torch.compiler.load_compiled_function(io.BytesIO(data))


def build(model: nn.Module, x: torch.Tensor, cache: Path | None) -> Any:
    with torch.no_grad():
        return compile_blocks(model, lambda: model(x), compile_one, load_one, context=CONTEXT,
                              cache=cache)


def seeded(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return stack(width=8, **kwargs).eval().requires_grad_(False)


# --- the payload ------------------------------------------------------------------------


def test_the_payload_round_trips_and_names_each_blocks_function() -> None:
    data = pack([b"first", b"", b"third"], {"layers.0": 0, "layers.1": 2, "layers.2": 0})
    assert is_blocks(data)
    assert unpack(data) == ([b"first", b"", b"third"], {"layers.0": 0, "layers.1": 2,
                                                        "layers.2": 0})


@pytest.mark.parametrize("tamper", [
    lambda d: d[:-1],                                   # a function cut short
    lambda d: d + b"x",                                 # bytes nobody accounts for
    lambda d: d.replace(b'"layers.0": 1', b'"layers.0": 5'),  # a function not in it
    lambda d: d.replace(b'"sizes"', b'"sixes"'),        # no sizes
    lambda d: d.replace(b"\n", b" ", 2),                # no end of header
])
def test_a_payload_that_does_not_add_up_is_refused(tamper: Any) -> None:
    data = pack([b"abc", b"de"], {"layers.0": 1, "layers.1": 0})
    with pytest.raises(BlocksFormatError):
        unpack(tamper(data))


def test_pack_refuses_a_block_without_its_function() -> None:
    with pytest.raises(ValueError, match="not in the payload"):
        pack([b"a"], {"layers.0": 1})


# --- keys ---------------------------------------------------------------------------------


def test_identical_layers_share_a_key_and_a_changed_one_does_not() -> None:
    x = torch.randn(2, 8)
    keys = build(seeded(layers=4, changed=2), x, None).keys
    assert keys[0] == keys[1] == keys[3] != keys[2]  # layer 2: SiLU, a plain attribute
    # Another instance of the same model: the same keys (the key reads no object ids).
    assert build(seeded(layers=4, changed=2), x, None).keys == keys


def test_the_key_follows_shapes_inputs_and_context() -> None:
    model = seeded(layers=2, distinct=True)
    x = torch.randn(2, 8)
    keys = build(model, x, None).keys
    b0 = model.layers[0]
    base = block_key(b0, (x,), {}, CONTEXT)
    assert base == keys[0] != keys[1]                                # hidden widths differ
    assert base != block_key(b0, (torch.randn(3, 8),), {}, CONTEXT)  # another batch
    assert base != block_key(b0, (x,), {}, {**CONTEXT, "torch": "0.0"})
    b0.train()
    assert base != block_key(b0, (x,), {}, CONTEXT)                  # training flag


def test_a_model_without_a_layer_list_is_refused_in_words() -> None:
    with pytest.raises(BlocksUnavailable, match="without per_block"):
        build(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), None)


class Twice(nn.Module):
    """Its first layer runs twice in one forward (weights shared across steps)."""

    def __init__(self, second: slice) -> None:
        super().__init__()
        self.layers = seeded(layers=2).layers
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](self.layers[0](x)[self.second]))


def test_a_block_that_runs_twice_is_served_twice_by_its_function() -> None:
    x = torch.randn(2, 8)
    model = Twice(slice(None))
    made = build(model, x, None)
    assert made.summary()["blocks"] == 2 and made.functions
    runner = BlockwiseModel(model, {n: made.functions[i] for n, i in made.assignment.items()})
    with torch.no_grad():
        assert torch.equal(runner(model, x), Twice(slice(None))(x))


def test_a_block_that_runs_again_on_other_shapes_is_refused_in_words() -> None:
    with pytest.raises(BlocksUnavailable, match=r"'layers\.0' ran again"):
        build(Twice(slice(0, 1)), torch.randn(2, 8), None)


def test_per_block_and_regional_exclude_each_other() -> None:
    assert CompileOptions.from_json({"per_block": "true"}).to_json()["per_block"] is True
    assert "per_block" not in CompileOptions().to_json()  # old keys keep their text
    with pytest.raises(SpecError, match="ask for one of them"):
        CompileOptions.from_json({"per_block": True, "regional": True})
    with pytest.raises(SpecError, match="per_block must be true or false"):
        CompileOptions.from_json({"per_block": "yes"})


# --- reuse --------------------------------------------------------------------------------


def test_identical_layers_compile_once_and_a_rebuild_compiles_nothing(tmp_path: Path) -> None:
    x = torch.randn(2, 8)
    model = seeded(layers=4, changed=2)
    first = build(model, x, tmp_path)
    # The SiLU layer's shape key is the GELU layers': their function is
    # offered to it first, and its guards refuse it.
    assert first.summary() == {"blocks": 4, "functions": 2, "compiled": 2, "from_cache": 0,
                               "shared": 2, "guard_refusals": 1, "compiled_in_parallel": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {block_key(model.layers[i], (x,), {}, CONTEXT, attributes=a)
         for i in (0, 2) for a in (True, False)})
    second = build(seeded(layers=4, changed=2), x, tmp_path)
    assert (second.compiled, second.from_cache, second.shared) == (0, 2, 2)


def test_one_changed_layer_of_distinct_layers_compiles_that_layer(tmp_path: Path) -> None:
    x = torch.randn(2, 8)
    cold = build(seeded(layers=4, distinct=True), x, tmp_path)
    assert (cold.compiled, cold.from_cache) == (4, 0)
    model = seeded(layers=4, distinct=True, changed=1)
    changed = build(model, x, tmp_path)
    assert (changed.compiled, changed.from_cache) == (1, 3)
    runner = BlockwiseModel(model, {n: changed.functions[i]
                                    for n, i in changed.assignment.items()})
    with torch.no_grad():
        assert torch.equal(runner(model, x), seeded(layers=4, distinct=True, changed=1)(x))


def test_a_stored_function_under_the_wrong_key_is_refused_by_its_guards(
        tmp_path: Path) -> None:
    """The keys are a lookup, not a proof: a GELU layer's function stored
    under the SiLU layer's keys (a collision, or a planted entry) fails the
    guards (Dynamo guards the attribute the forward reads), and the block is
    compiled anew; the model still computes what eager does."""
    x = torch.randn(2, 8)
    model = seeded(layers=3, changed=1)
    build(model, x, tmp_path)
    gelu = block_key(model.layers[0], (x,), {}, CONTEXT)
    for attributes in (True, False):
        silu = tmp_path / block_key(model.layers[1], (x,), {}, CONTEXT, attributes=attributes)
        silu.write_bytes((tmp_path / gelu).read_bytes())
    again = build(model, x, tmp_path)
    assert (again.compiled, again.from_cache) == (1, 1)
    assert again.refused >= 1
    runner = BlockwiseModel(model, {n: again.functions[i] for n, i in again.assignment.items()})
    with torch.no_grad():
        assert torch.equal(runner(model, x), seeded(layers=3, changed=1)(x))


def test_layers_that_differ_in_an_attribute_the_forward_never_reads_share_a_function(
        tmp_path: Path) -> None:
    """transformers' decoder layers each keep their own ``layer_idx``: their
    exact keys differ, their shape keys do not, and the guards (which read
    only what the forward read) accept one function for all of them."""
    x = torch.randn(2, 8)
    model = seeded(layers=3)
    for i, layer in enumerate(model.layers):
        layer.layer_idx = i
    made = build(model, x, tmp_path)
    assert (made.compiled, made.shared) == (1, 2)
    again = seeded(layers=3)
    for i, layer in enumerate(again.layers):
        layer.layer_idx = i
    assert (build(again, x, tmp_path).compiled) == 0


def test_a_stored_entry_holding_a_function_already_loaded_counts_as_shared(
        tmp_path: Path) -> None:
    """Every served block is counted once: compiled, from the cache, or
    shared. An entry under a key of its own whose bytes are a function this
    build already loaded serves the block as that function (shared)."""
    from farm.build.blocks import BlockBuild, _from_cache

    x = torch.randn(2, 8)
    model = seeded(layers=2)
    made = build(model, x, None)
    out = BlockBuild()
    out.functions.append(made.functions[0])
    out.saved.append(made.saved[0])
    (tmp_path / "other-key").write_bytes(made.saved[0])
    with torch.no_grad():
        got = _from_cache(out, tmp_path, "other-key", load_one, model.layers[1], (x,), {})
    assert (got, out.shared, out.from_cache, out.refused) == (0, 1, 0, 0)
    wider = seeded(layers=2, distinct=True).layers[1]  # its own width: the guards refuse
    with torch.no_grad():
        got = _from_cache(out, tmp_path, "other-key", load_one, wider, (torch.randn(2, 8),), {})
    assert (got, out.shared, out.from_cache) == (None, 1, 0)


def test_a_corrupt_stored_function_is_compiled_again(tmp_path: Path) -> None:
    x = torch.randn(2, 8)
    model = seeded(layers=2)
    build(model, x, tmp_path)
    for entry in tmp_path.iterdir():
        entry.write_bytes(b"not a compiled function")
    again = build(model, x, tmp_path)
    assert (again.compiled, again.from_cache) == (1, 0)


def test_the_node_runs_blocks_through_their_functions_and_keeps_the_class() -> None:
    x = torch.randn(2, 8)
    model = seeded(layers=3)
    made = build(model, x, None)
    calls: list[str] = []
    fn = made.functions[0]

    def counting(block: nn.Module, *a: Any) -> Any:
        calls.append("compiled")
        return fn(block, *a)

    runner = BlockwiseModel(model, dict.fromkeys(made.assignment, counting))
    with torch.no_grad():
        assert torch.equal(runner(model, x), seeded(layers=3)(x))
    assert calls == ["compiled"] * 3
    assert "forward" not in vars(seeded(layers=1).layers[0])  # other instances untouched
    with pytest.raises(ValueError, match="the module it was loaded with"):
        runner(seeded(layers=3), x)


def test_the_node_calls_blocks_past_torchs_argument_binding_and_still_checks_guards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's block call builds the guards' locals itself
    (``direct_call``: torch's call binds them with ``inspect`` on every
    call); the guards still refuse what they refused, through torch's call
    and its reason, and ``disable_guard_check`` still turns them off."""
    import torch._dynamo.aot_compile as aot_compile

    from farm.node.blocks import direct_call

    binds: list[str] = []
    bind_locals = aot_compile.bind_locals

    def counting_bind(*args: Any, **kwargs: Any) -> Any:
        binds.append("bind")
        return bind_locals(*args, **kwargs)

    monkeypatch.setattr(aot_compile, "bind_locals", counting_bind)
    x = torch.randn(2, 8)
    made = build(seeded(layers=3), x, None)
    loaded = load_one(made.saved[0])
    assert direct_call(loaded) is not None, "this torch's loaded functions changed shape"
    model = seeded(layers=3)
    runner = BlockwiseModel(model, dict.fromkeys(made.assignment, loaded))
    binds.clear()
    with torch.no_grad():
        assert torch.equal(runner(model, x), seeded(layers=3)(x))
        assert binds == []  # three block calls, none through torch's binding
        wider = torch.randn(3, 8)  # the build's shapes are static: the guards refuse it
        with pytest.raises(RuntimeError, match="GuardManager check failed"):
            runner(model, wider)
        assert binds, "a refusal goes through torch's call, for its reason"
        runner.disable_guard_check()
        assert torch.equal(runner(model, wider), seeded(layers=3)(wider))
    assert direct_call(lambda block, *a: block(*a)) is None  # not torch's: called as it is


def test_the_build_gives_the_blocks_their_forward_back_for_the_next_format(
        tmp_path: Path) -> None:
    """The compile child builds the aot_compile format and then exports the
    same model for AOTI: a block still patched with its compiled function
    would be traced through that function's guards (which refused torch.export's
    fake inputs on the GPU host: "AOTI FAILED ... GuardManager check failed")."""
    from farm.build.compile import compile_aot
    from farm.core.specs import JobSpec
    from farm.node.loader import load_artifact

    spec = JobSpec.from_json({
        "name": "blocks", "version": "1",
        "model": {"entrypoint": "farm.zoo.stack:stack", "kwargs": {"layers": 3, "width": 8}},
        "inputs": ["float32[2,8]"], "options": {"backend": "eager", "per_block": True}})
    model = seeded(layers=3)
    with torch.no_grad():
        meta = compile_aot(spec, model, torch.device("cpu"), tmp_path / "art")
    assert meta["per_block"]["functions"] == 1
    assert not any("forward" in vars(layer) for layer in model.layers)
    x = torch.randn(2, 8)
    torch.export.export(model, (x,))
    node_model = seeded(layers=3)
    fn = load_artifact(tmp_path / "art", "aot_compile", module=node_model, trust_unverified=True)
    with torch.no_grad():
        assert torch.equal(fn(x), seeded(layers=3)(x))


def per_block_job(inputs: str = "float32[2,8]", **options: Any) -> Any:
    from farm.core.specs import JobSpec

    return JobSpec.from_json({
        "name": "blocks", "version": "1",
        "model": {"entrypoint": "farm.zoo.stack:stack", "kwargs": {"layers": 2, "width": 8}},
        "inputs": [inputs], "options": {"backend": "eager", "per_block": True, **options}})


def test_a_build_with_fake_weights_is_refused_in_words(tmp_path: Path) -> None:
    """The build runs each block's compiled function to feed the next block,
    which FakeTensor weights (a model too big for the build device) cannot do."""
    from farm.build.compile import compile_aot
    from farm.build.compile_common import CompileError
    from farm.build.fake_weights import WEIGHTS_FAKE, WeightsPlan, fake_tensor_mode

    plan = WeightsPlan(mode=WEIGHTS_FAKE, why="asked", fake_mode=fake_tensor_mode())
    with pytest.raises(CompileError, match="per_block needs weights it can run"):
        compile_aot(per_block_job(weights="fake"), seeded(layers=2), torch.device("cpu"),
                    tmp_path / "art", weights=plan)


@pytest.mark.parametrize(("inputs", "model", "says"), [
    ("float32[2..8,8]", lambda: seeded(layers=2), "has dynamic dimensions: build it without"),
    ("float32[2,8]", lambda: nn.Sequential(nn.Linear(8, 8)), "needs a model whose forward runs "
                                                             "a list of blocks"),
])
def test_what_a_per_block_build_cannot_take_fails_it_in_words(
        tmp_path: Path, inputs: str, model: Any, says: str) -> None:
    from farm.build.compile import compile_aot
    from farm.build.compile_common import CompileError

    with torch.no_grad(), pytest.raises(CompileError, match=says):
        compile_aot(per_block_job(inputs), model(), torch.device("cpu"), tmp_path / "art")


# --- distinct blocks compiled side by side ------------------------------------------------

_SIDE_BY_SIDE = """
import io, json, os, sys
from pathlib import Path
import torch
from farm.build.blocks import compile_blocks, precompile_in_parallel
from farm.node.blocks import BlockwiseModel
from tests.unit.test_blocks import CONTEXT, compile_one as compile_block, load_one, seeded

cache, marks = Path(sys.argv[1]), Path(sys.argv[2])

def compile_one(block, args, kwargs):
    (marks / str(os.getpid())).touch()   # which process compiled
    return compile_block(block, args, kwargs)

out = {"me": str(os.getpid())}
x = torch.randn(2, 8)
with torch.no_grad():
    for name, model in (("distinct", seeded(layers=4, distinct=True)),
                        ("identical", seeded(layers=4))):
        fresh = precompile_in_parallel(model, lambda: model(x), compile_one, context=CONTEXT,
                                       cache=cache / name, workers=2)
        side = sorted(p.name for p in marks.iterdir())
        made = compile_blocks(model, lambda: model(x), compile_one, load_one, context=CONTEXT,
                              cache=cache / name, fresh=fresh)
        runner = BlockwiseModel(model, {n: made.functions[i] for n, i in made.assignment.items()})
        out[name] = {"fresh": len(fresh), "side": side, "summary": made.summary(),
                     "same": torch.equal(runner(model, x), model(x))}
        for p in marks.iterdir():
            p.unlink()
print(json.dumps(out))
"""


def test_distinct_blocks_compiled_side_by_side_serve_the_pass_after(tmp_path: Path) -> None:
    """In a process of one thread, as a CPU build child is: the 4 distinct
    blocks are compiled by 2 forked processes and stored under both keys;
    the pass after compiles none itself, counts them as compiled, and the
    model computes what eager does. Identical blocks are one block: nothing
    to run side by side, so no process is forked."""
    import json
    import subprocess
    import sys

    marks = tmp_path / "marks"
    marks.mkdir()
    done = subprocess.run([sys.executable, "-c", _SIDE_BY_SIDE, str(tmp_path / "cache"),
                           str(marks)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    distinct = out["distinct"]
    assert distinct["fresh"] == 8, distinct           # 4 blocks, each under 2 keys
    assert len(distinct["side"]) == 2 and out["me"] not in distinct["side"], distinct
    assert {k: distinct["summary"][k] for k in ("compiled", "from_cache",
                                                "compiled_in_parallel")} == {
        "compiled": 4, "from_cache": 0, "compiled_in_parallel": 4}, distinct
    assert distinct["same"]
    identical = out["identical"]
    assert identical["fresh"] == 0 and identical["side"] == [], identical
    assert identical["summary"]["compiled"] == 1 and identical["same"], identical


def test_a_process_with_other_threads_compiles_its_blocks_one_after_another(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fork copies only the calling thread (a lock another thread held
    stays held): with a second thread alive, nothing is forked."""
    import threading

    from farm.build.blocks import precompile_in_parallel

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with caplog.at_level("INFO", logger="farm.build.blocks"), torch.no_grad():
            model, x = seeded(layers=4, distinct=True), torch.randn(2, 8)
            fresh = precompile_in_parallel(model, lambda: model(x), compile_one,
                                           context=CONTEXT, cache=tmp_path, workers=2)
    finally:
        stop.set()
        other.join()
    assert fresh == set() and not list(tmp_path.iterdir())
    assert "threads: no fork" in caplog.text


def test_a_fork_the_process_limit_refuses_leaves_the_blocks_to_the_pass_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import os
    import threading

    from farm.build.blocks import precompile_in_parallel

    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(os, "fork", no_fork)
    model, x = seeded(layers=4, distinct=True), torch.randn(2, 8)
    with caplog.at_level("INFO", logger="farm.build.blocks"), torch.no_grad():
        fresh = precompile_in_parallel(model, lambda: model(x), compile_one, context=CONTEXT,
                                       cache=tmp_path, workers=2)
    assert fresh == set()
    assert "0 of 2 processes started" in caplog.text
    made = build(model, x, tmp_path)
    assert (made.compiled, made.in_parallel) == (4, 0)
