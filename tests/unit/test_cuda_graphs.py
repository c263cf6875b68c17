"""farm.node.cuda_graphs: a node's calls replayed from CUDA graphs.

The refusals (a CPU tensor, grad on, an argument that cannot be keyed) run
everywhere; recording and replaying need a GPU (``scripts/gpu_node_graphs.sh``
runs this file there): a replay computes what the call would, sees weights
changed in place, records anew when weights move or are replaced, leaves a
forward that reads a tensor's value to the artifact with the reason, and
serves a real per-block and full-graph artifact; a training call replays its
forward and backward with the gradients of the call it stands for, over
steps, accumulated, and where a second forward comes before the first's
backward.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from farm.node.cuda_graphs import WARM_UP_CALLS, GraphedCalls

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Counted(torch.nn.Module):
    """A small MLP that counts the Python calls of its forward: a replay
    makes none."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 16)
        self.calls = 0
        self.read_a_value = False
        self.query_the_stream = False

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.a(x))
        if self.read_a_value and h.sum().item() > -1:   # a host read: not recordable
            h = h * 1.0
        if self.query_the_stream:   # no wait, but not allowed while recording
            torch.cuda.current_stream().query()
        return self.b(h) * scale


def _graphed(device: str) -> tuple[Counted, GraphedCalls]:
    torch.manual_seed(0)
    m = Counted().to(device).eval()
    return m, GraphedCalls(m, m)


def _eager(m: Counted, *args: Any, **kwargs: Any) -> torch.Tensor:
    calls = m.calls
    with torch.no_grad():
        out = m(*args, **kwargs)
    m.calls = calls
    return out


# --- refusals: anywhere ---------------------------------------------------------------------

def test_a_call_on_cpu_runs_as_it_is_and_says_why() -> None:
    m, g = _graphed("cpu")
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = g(x)
    assert torch.equal(out, _eager(m, x))
    assert g.captured == 0
    assert "cpu, not a CUDA device" in g.reasons["a call"]


def test_a_call_with_grad_runs_as_it_is() -> None:
    _, g = _graphed("cpu")
    x = torch.randn(4, 32)
    out = g(x)
    assert out.requires_grad
    assert "only calls without grad" in g.reasons["a call with grad enabled"]


def test_a_training_call_on_cpu_runs_as_it_is() -> None:
    torch.manual_seed(0)
    m = Counted()
    g = GraphedCalls(m, m, training=True)
    x = torch.randn(4, 32)
    g(x).sum().backward()
    assert m.a.weight.grad is not None
    assert "cpu, not a CUDA device" in g.reasons["a call"]


def test_an_argument_that_cannot_be_keyed_is_named() -> None:
    class Opaque:
        pass

    def fn(x: Any) -> Any:
        return 1

    g = GraphedCalls(fn, None)
    with torch.no_grad():
        assert g(Opaque()) == 1
    assert "an argument is a Opaque" in g.reasons["a call"]


# --- recording and replaying: a GPU ---------------------------------------------------------

@cuda
def test_a_replay_computes_the_call_and_its_results_are_the_callers() -> None:
    m, g = _graphed("cuda")
    xs = [torch.randn(8, 32, device="cuda") for _ in range(4)]
    with torch.no_grad():
        outs = [g(x, scale=2.0) for x in xs]
    # Recorded once (after its warm-up calls), then replayed: no Python call.
    assert m.calls == WARM_UP_CALLS + 1
    assert g.captured == 1 and not g.reasons
    for x, out in zip(xs, outs, strict=True):
        # Each result is the caller's: the next replay did not rewrite it.
        torch.testing.assert_close(out, _eager(m, x, scale=2.0))
    # Another value of a keyed argument, and another shape: recorded apart.
    with torch.no_grad():
        torch.testing.assert_close(g(xs[0], scale=3.0), _eager(m, xs[0], scale=3.0))
        y = torch.randn(2, 32, device="cuda")
        torch.testing.assert_close(g(y), _eager(m, y))
    assert g.captured == 3


@cuda
def test_weights_changed_in_place_are_read_and_replaced_weights_recorded_anew() -> None:
    m, g = _graphed("cuda")
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        g(x)
        m.a.weight.mul_(2)                      # load_state_dict does this
        calls = m.calls
        torch.testing.assert_close(g(x), _eager(m, x))
        assert m.calls == calls                 # a replay

        m.b.weight = torch.nn.Parameter(torch.randn_like(m.b.weight))   # assigned
        torch.testing.assert_close(g(x), _eager(m, x))
        assert m.calls == calls + WARM_UP_CALLS + 1

        m.a.weight.data = m.a.weight.data.clone() * 0.5                 # moved
        torch.testing.assert_close(g(x), _eager(m, x))
        assert m.calls == calls + 2 * (WARM_UP_CALLS + 1)
    assert g.captured == 1


@cuda
def test_a_forward_that_reads_a_value_runs_on_the_artifact_with_the_reason() -> None:
    m, g = _graphed("cuda")
    m.read_a_value = True
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        first = g(x)
        calls = m.calls
        second = g(x)
    torch.testing.assert_close(first, _eager(m, x))
    torch.testing.assert_close(second, _eager(m, x))
    assert m.calls == calls + 1                 # not recorded again: run as it is
    assert g.captured == 0
    # Found before recording: the host waited for the GPU.
    assert "waits for the GPU on the host" in g.reasons["a call of this shape"]
    assert torch.randn(4, device="cuda").isfinite().all()


@cuda
def test_a_recording_that_fails_leaves_the_gpu_usable() -> None:
    """A capture that fails half-way leaves torch's CUDA random generator
    capturing: every later random op would fail, unless mended."""
    m, g = _graphed("cuda")
    m.query_the_stream = True
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(g(x), _eager(m, x))
    assert g.captured == 0
    assert "recording it failed" in g.reasons["a call of this shape"]
    assert torch.randn(4, device="cuda").isfinite().all()
    torch.nn.init.normal_(torch.empty(8, 8, device="cuda"))
    # And a recordable model records after it.
    m2, g2 = _graphed("cuda")
    with torch.no_grad():
        torch.testing.assert_close(g2(x), _eager(m2, x))
    assert g2.captured == 1


@cuda
def test_another_torch_state_than_recorded_runs_as_it_is() -> None:
    m, g = _graphed("cuda")
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        g(x)
        calls = m.calls
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = g(x)
            want = _eager(m, x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)
    assert m.calls == calls + 1


@cuda
def test_shapes_beyond_the_limit_run_as_they_are() -> None:
    m, _ = _graphed("cuda")
    g = GraphedCalls(m, m, max_graphs=1)
    with torch.no_grad():
        g(torch.randn(8, 32, device="cuda"))
        y = torch.randn(3, 32, device="cuda")
        torch.testing.assert_close(g(y), _eager(m, y))
    assert g.captured == 1
    assert "1 graphs are kept" in g.reasons["a call of a new shape"]


@cuda
@pytest.mark.parametrize("per_block", [False, True], ids=["full-graph", "per-block"])
def test_a_farm_artifact_replayed_matches_its_own_call(per_block: bool) -> None:
    from farm.build.compile import compile_artifacts
    from farm.core.inputs import parse_inputs
    from farm.core.modelref import apply_grad_mode, build_real, example_inputs
    from farm.core.specs import CompileOptions, GradMode, JobSpec, ModelRef
    from farm.node.loader import load_artifact

    spec = JobSpec(name="graphs", version="1",
                   model=ModelRef("farm.zoo.llama:llama",
                                  kwargs={"vocab": 256, "dim": 64, "n_layers": 3, "n_heads": 2,
                                          "n_kv_heads": 1, "ffn_dim": 176}),
                   inputs=parse_inputs(["int64[1,16]{0..255}"]), grad_mode=GradMode.INFERENCE,
                   options=CompileOptions(per_block=per_block))
    (art,) = compile_artifacts(spec, "cuda", Path(tempfile.mkdtemp()), formats=["aot_compile"])
    m = build_real(spec.model, device="cuda", seed=0)
    apply_grad_mode(m, spec.grad_mode)
    fn = load_artifact(art.path, "aot_compile", module=m, trust_unverified=True)
    g = GraphedCalls(fn, m)
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(seed)
            (x,) = example_inputs(spec.inputs, device="cuda", mark_dynamic=False)
            torch.testing.assert_close(g(x), fn(x))
    assert g.captured == 1 and not g.reasons


# --- training calls: a GPU ------------------------------------------------------------------

def _pair() -> tuple[Counted, Counted, GraphedCalls]:
    """A model replayed in training and its twin run as it is."""
    torch.manual_seed(0)
    m = Counted().to("cuda").train()
    twin = Counted().to("cuda").train()
    twin.load_state_dict(m.state_dict())
    return m, twin, GraphedCalls(m, m, training=True)


def _grads(m: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return out


@cuda
def test_training_steps_replayed_give_the_calls_gradients() -> None:
    m, twin, g = _pair()
    opt, twin_opt = (torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (m, twin))
    for _ in range(4):
        x = torch.randn(8, 32, device="cuda", requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        loss, twin_loss = g(x).pow(2).mean(), twin(x_twin).pow(2).mean()
        loss.backward()
        twin_loss.backward()
        torch.testing.assert_close(loss, twin_loss)
        torch.testing.assert_close(x.grad, x_twin.grad)     # an input's gradient
        for a, b in zip(m.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
        opt.step()            # in place: the next replay reads the new weights
        twin_opt.step()
        opt.zero_grad()
        twin_opt.zero_grad()
    # Recorded once (its warm-up calls and the recording), then replayed.
    assert m.calls == WARM_UP_CALLS + 1
    assert g.captured == 1 and not g.reasons
    # Eval mode is another key: recorded apart.
    m.eval()
    twin.eval()
    x = torch.randn(8, 32, device="cuda")
    torch.testing.assert_close(g(x), twin(x))
    assert g.captured == 2


@cuda
def test_gradients_accumulated_over_replayed_steps_are_each_steps_own() -> None:
    m, twin, g = _pair()
    xs = [torch.randn(8, 32, device="cuda") for _ in range(3)]
    for x in xs:              # no zero_grad between them: .grad adds up
        g(x).sum().backward()
        twin(x).sum().backward()
    for a, b in zip(_grads(m), _grads(twin), strict=True):
        torch.testing.assert_close(a, b)


@cuda
def test_a_second_forward_before_the_first_backward_runs_as_it_is() -> None:
    m, twin, g = _pair()
    x, y = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
    g(x).sum().backward()     # recorded
    m.zero_grad(set_to_none=True)
    calls = m.calls
    (g(x).sum() + g(y).sum()).backward()    # one loss over two calls of one shape
    (twin(x).sum() + twin(y).sum()).backward()
    assert m.calls == calls + 1             # the second ran as it is
    assert any("before the backward" in what for what in g.reasons)
    # Its gradients are those of the two calls, not two of the second.
    for a, b in zip(_grads(m), _grads(twin), strict=True):
        torch.testing.assert_close(a, b)
    # Once that graph is gone, the next call replays again.
    calls = m.calls
    g(x).sum().backward()
    assert m.calls == calls


@cuda
def test_a_backward_after_a_later_replay_of_its_shape_raises() -> None:
    _, _, g = _pair()
    x = torch.randn(8, 32, device="cuda")
    g(x).sum().backward()     # recorded
    kept = g(x).sum()
    kept.backward(retain_graph=True)
    g(x).sum().backward()     # a later replay rewrote kept's activations
    with pytest.raises(RuntimeError, match="replayed again since"):
        kept.backward()


@cuda
def test_a_farm_training_artifact_replayed_gives_its_own_calls_gradients() -> None:
    from farm.build.compile import compile_artifacts
    from farm.core.inputs import parse_inputs
    from farm.core.modelref import apply_grad_mode, build_real, example_inputs
    from farm.core.specs import GradMode, JobSpec, ModelRef
    from farm.node.loader import load_artifact

    spec = JobSpec(name="graphs-train", version="1",
                   model=ModelRef("farm.zoo.llama:llama",
                                  kwargs={"vocab": 256, "dim": 64, "n_layers": 3, "n_heads": 2,
                                          "n_kv_heads": 1, "ffn_dim": 176}),
                   inputs=parse_inputs(["int64[1,16]{0..255}"]), grad_mode=GradMode.TRAINING)
    (art,) = compile_artifacts(spec, "cuda", Path(tempfile.mkdtemp()), formats=["aot_compile"])
    models = [build_real(spec.model, device="cuda", seed=0) for _ in range(2)]
    for m in models:
        apply_grad_mode(m, spec.grad_mode)
    fns = [load_artifact(art.path, "aot_compile", module=m, trust_unverified=True)
           for m in models]
    g = GraphedCalls(fns[0], models[0], training=True)
    for seed in range(3):
        torch.manual_seed(seed)
        (x,) = example_inputs(spec.inputs, device="cuda", mark_dynamic=False)
        losses = [f(x).float().pow(2).mean() for f in (g, fns[1])]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(*losses)
        for a, b in zip(_grads(models[0]), _grads(models[1]), strict=True):
            torch.testing.assert_close(a, b)
    assert g.captured == 1 and not g.reasons
