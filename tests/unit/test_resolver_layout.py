"""Resolver rule ``layout``: a tensor-parallel artifact serves any
rank of the world size and mesh it was built for, and nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from farm.core.specs import CompileOptions, MeshLayout, ParallelLayout, SpecError
from registry import resolver
from tests.unit.test_resolver import art, only, reason

TP2 = MeshLayout(world_size=2, mesh_shape=(2,), mesh_dim_names=("tp",))
PLAN = (("linear1", "colwise"), ("linear2", "rowwise"))


def tp_art(id: int, mesh: MeshLayout = TP2, **kw: Any) -> Any:
    opts = CompileOptions(backend="eager", parallel=ParallelLayout(mesh=mesh, plan=PLAN))
    return art(id, options=opts, **kw)


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_one_artifact_serves_every_rank(rank: int | None) -> None:
    assert only(tp_art(1), layout=TP2, rank=rank).best is not None


def test_a_node_of_another_world_size_is_refused_with_both_layouts() -> None:
    tp4 = MeshLayout(world_size=4, mesh_shape=(4,), mesh_dim_names=("tp",))
    assert reason(tp_art(1), layout=tp4) == (
        "layout", "built for world 2, mesh [tp:2], the node runs world 4, mesh [tp:4]")


def test_a_node_whose_mesh_dims_are_named_otherwise_is_refused() -> None:
    dp = MeshLayout(world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",))
    assert reason(tp_art(1), layout=dp) == (
        "layout", "built for world 2, mesh [tp:2], the node runs world 2, mesh [dp:2]")


def test_a_rank_outside_the_mesh_is_refused() -> None:
    assert reason(tp_art(1), layout=TP2, rank=2) == (
        "layout", "rank 2 is outside world 2, mesh [tp:2]")


def test_a_node_without_a_layout_gets_no_parallel_artifact_and_vice_versa() -> None:
    code, why = reason(tp_art(1))
    assert code == "layout" and "states no layout" in why
    assert reason(art(2), layout=TP2) == (
        "layout", "built for one process, the node runs world 2, mesh [tp:2]")
    assert only(art(3)).best is not None


def test_layout_runs_after_grad_mode_and_before_options() -> None:
    codes = list(resolver.CODES)
    assert codes.index("grad_mode") < codes.index("layout") < codes.index("options")
    # Options that differ only in the layout are refused as a layout, which says why.
    other = CompileOptions(backend="eager", parallel=ParallelLayout(mesh=TP2, plan=PLAN))
    tp4 = MeshLayout(world_size=4, mesh_shape=(4,))
    assert reason(tp_art(1, mesh=tp4), layout=TP2, options=other)[0] == "layout"


def test_the_layout_is_in_the_options_text_and_so_in_the_build_key() -> None:
    opts = CompileOptions.from_json({"backend": "eager", "parallel": {
        "world_size": 2, "mesh_shape": [2], "mesh_dim_names": ["tp"],
        "plan": {"linear2": "rowwise", "linear1": "colwise"}}})
    assert opts.parallel == ParallelLayout(mesh=TP2, plan=PLAN)
    assert '"parallel":{"mesh_dim_names":["tp"],"mesh_shape":[2],' in opts.canonical()
    assert CompileOptions.from_json(opts.to_json()) == opts
    assert CompileOptions(backend="eager").canonical() != opts.canonical()


@pytest.mark.parametrize(("data", "message"), [
    ({"world_size": 3, "mesh_shape": [2], "plan": {"a": "colwise"}}, "holds 2 ranks"),
    ({"world_size": 4, "mesh_shape": [2, 2], "plan": {"a": "colwise"}}, "needs a 1-D mesh"),
    ({"world_size": 2, "mesh_shape": [2], "plan": {"a": "sequence"}}, "unknown parallel style"),
    ({"world_size": 2, "mesh_shape": [2], "plan": {}}, "at least one module"),
    ({"world_size": 2, "mesh_shape": [2], "plan": {"a b": "colwise"}}, "bad module path"),
    ({"world_size": 2, "mesh_shape": [2], "mesh_dim_names": ["tp", "x"],
      "plan": {"a": "colwise"}}, "one distinct identifier per mesh dim"),
    ({"world_size": 2, "plan": {"a": "colwise"}, "ranks": 2}, "unknown layout fields: ranks"),
])
def test_bad_layouts_say_what_is_wrong(data: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ParallelLayout.from_json(data)
