"""A graph identity that is the same in every build of the same program, so
torch's AOTAutograd cache (and the FX graph cache under it) can hit across
builds.

Why it never hit: Dynamo names each graph it hands a backend
``__compiled_fn_<n>_<uuid4>`` (``torch._dynamo.output_graph``), and under
``aot_compile`` that name becomes the AOTConfig's ``precompile_backend_id``,
which is part of the AOTAutograd cache key
(``AOTAutogradCachePickler._reduce_aot_config``). A fresh uuid per process
made every key new: the entries the farm's shared compile cache carried
(``farm.build.compile_cache``) were written and never read.

What the name is for: the saved function looks its compiled graph up under
it, in globals of its own (``torch._dynamo.convert_frame``'s
``forward_callable`` builds a fresh dict per loaded artifact), so it must be
unique within one artifact, not across artifacts or processes. Dynamo's
counter (``<n>``) keeps it unique within the process; the uuid is replaced by
a fixed word. Everything else the key holds (the graph's code, the example
inputs' metadata, the configs, torch's own version) still decides a hit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

STABLE_SUFFIX = "farm"


@contextlib.contextmanager
def stable_graph_id() -> Iterator[None]:
    """Within the block, Dynamo's graph names carry no uuid. A torch without
    the name (another version) is left as it is: its cache then misses, as
    before, and nothing else changes."""
    try:
        from torch._dynamo import output_graph
    except ImportError:  # pragma: no cover - torch without Dynamo
        yield
        return
    original = getattr(output_graph, "unique_id", None)
    if original is None:  # pragma: no cover - a torch that names graphs otherwise
        yield
        return

    def unique_id(name: str, with_uuid: bool = False) -> str:
        plain: str = original(name)
        return f"{plain}_{STABLE_SUFFIX}" if with_uuid else plain

    output_graph.unique_id = unique_id
    try:
        yield
    finally:
        output_graph.unique_id = original


@contextlib.contextmanager
def aot_cache_outcome() -> Iterator[dict[str, str]]:
    """Yields a dict that holds, after the block, what torch's AOTAutograd
    cache did for the compile inside it: ``hit``, ``miss`` or ``bypass``
    (torch's own counters)."""
    from torch._dynamo.utils import counters

    def snap() -> dict[str, int]:
        return dict(counters["aot_autograd"])

    out: dict[str, str] = {}
    before = snap()
    try:
        yield out
    finally:
        after = snap()
        grew = {k for k, v in after.items() if v > before.get(k, 0)}
        for outcome in ("hit", "miss", "bypass"):
            if f"autograd_cache_{outcome}" in grew:
                out["outcome"] = outcome
                break


def backend_id_of(compiled_fn: Any) -> str | None:
    """The graph name a saved ``aot_compile`` function carries (tests, logs)."""
    artifacts = getattr(compiled_fn, "_artifacts", None)
    return getattr(artifacts, "backend_id", None)
