"""Shared compile caches (farm.build.compile_cache) on real Redis, wired as the
compile worker wires them: the worker prefills the sandboxed child's cache
directories from the target's namespace and harvests what the child added.

A target's entries are never used by another target; a new salt disowns
them; a poisoned store does not get a wrong artifact past the fresh-process
verification."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.build.compile_cache import CacheSession, RedisCacheStore, namespace
from farm.build.sandbox import build_isolation, run_isolated
from farm.build.steps import compile_env
from farm.build.toolchain import choose_compiler
from farm.build.verify import verify_artifact
from farm.core.specs import JobSpec
from farm.core.target import detect_local_target
from tests.fixtures.builds import fill_header_store
from tests.integration.test_api import CPU, CPU_512, Api, _api
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Inductor (an eager build compiles nothing to cache), small, aot_compile only.
SPEC = JobSpec.from_json({
    "name": "cache-stack", "version": "1",
    "model": {"entrypoint": "farm.zoo.stack:stack", "kwargs": {"layers": 3, "width": 16}},
    "inputs": ["float32[2,16]"]})


def build(store: RedisCacheStore, ns: str, tmp: Path,
          spec: JobSpec = SPEC, *, aoti: bool = False) -> tuple[CacheSession, Any]:
    """One compile the way workers.tasks._compile_and_store runs it
    (``aoti``: the AOTI package only, else aot_compile only)."""
    tmp.mkdir()
    cache = CacheSession(store, ns, tmp)
    cache.prefill()
    # With the compiler the host chose, as a worker names it (compile_env
    # holds its other answers: the ISA checks made once per machine).
    payload: dict[str, Any] = {"spec": spec.to_json(), "device": "cpu",
                               "out_dir": str(tmp / "out"), "cxx": choose_compiler("cpu").cxx}
    if aoti:
        entry, payload["formats"] = "farm.build.compile:compile_job", ["aoti"]
    else:
        entry, payload["aoti_unavailable"] = "farm.build.steps:compile_step", "not under test"
    res = run_isolated(
        entry, payload, timeout_s=scaled(600), memory_mb=6000,
        env_extra=compile_env(tmp),
        isolation=build_isolation(writable=(str(tmp),), mode="auto"))
    return cache, res


def kernels(names: set[str]) -> set[str]:
    """Compiled C++ kernels: what a CPU build spends its time on."""
    return {n for n in names if n.endswith(".so")}


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    yield from _api(db_url, tmp_path)


@pytest.fixture
def store(redis_url: str) -> RedisCacheStore:
    return RedisCacheStore(redis_url)


def test_a_targets_entries_are_never_used_by_another(store: RedisCacheStore,
                                                     build_tmp: Path) -> None:
    here = detect_local_target("cpu")
    # Another target for the same machine's code: one more thread (a real
    # target string; the thread count is baked into CPU kernels).
    other = dataclasses.replace(here, threads=(here.threads or 1) + 1)
    prefix = f"farm:ccache:test-{uuid.uuid4().hex[:8]}"
    ns_a = namespace(str(here), "0", prefix=prefix)
    ns_b = namespace(str(other), "0", prefix=prefix)
    assert ns_a != ns_b

    cold, res = build(store, ns_a, build_tmp / "a1")
    assert res.ok, res.error
    cold.harvest()
    a_names = store.names(ns_a)
    assert cold.stats["prefilled"] == 0 and kernels(a_names), cold.stats

    # Target B starts from nothing though A's entries are in the same Redis:
    # it compiles every kernel itself, into its own namespace.
    b, res = build(store, ns_b, build_tmp / "b1")
    assert res.ok, res.error
    assert b.stats["prefilled"] == 0
    b.harvest()
    assert kernels(store.names(ns_b)) == kernels(a_names)  # same code, compiled again
    assert store.names(ns_a) == a_names  # B wrote nothing into A's namespace

    # A again: every kernel comes from A's cache; none is compiled anew.
    warm, res = build(store, ns_a, build_tmp / "a2")
    assert res.ok, res.error
    assert warm.stats["prefilled"] == len(a_names)
    warm.harvest()
    assert not kernels(store.names(ns_a) - a_names)

    # A new salt disowns A's entries.
    salted, _ = CacheSession(store, namespace(str(here), "1", prefix=prefix),
                             build_tmp / "a3"), None
    assert salted.prefill() == 0


def test_a_poisoned_entry_is_stopped_by_the_fresh_process_verification(
        store: RedisCacheStore, build_tmp: Path) -> None:
    """A plausible poisoned entry: the generated wrapper of the model's graph,
    under its own key, doubling every output, both as a file and inside
    torch's AOTAutograd entry for the graph (which a build of the same graph
    now loads instead of compiling: farm.build.graph_identity). It loads, the
    build uses it and the artifact computes the wrong thing (the cache does
    reach the bytes); the verification in a fresh process with an empty cache
    refuses it, so the worker stores and serves nothing."""
    prefix = f"farm:ccache:test-{uuid.uuid4().hex[:8]}"
    clean = namespace("cpu/clean", "0", prefix=prefix)
    cold, res = build(store, clean, build_tmp / "clean")
    assert res.ok, res.error
    cold.harvest()
    entries = dict(store.entries(clean))
    wrappers = [n for n in entries if n.endswith(".py")]
    assert wrappers, sorted(entries)
    aot_entries = [n for n in entries if "/aotautograd/" in n]
    assert aot_entries, sorted(entries)
    poisoned = namespace("cpu/poisoned", "0", prefix=prefix)
    for name, data in entries.items():
        if name in wrappers:
            data += POISON
        elif name in aot_entries:
            data = _poison_aot_entry(data)
        store.put(poisoned, name, data)

    cache, res = build(store, poisoned, build_tmp / "poisoned")
    assert cache.stats["prefilled"] == len(entries)
    assert res.ok, res.error
    # The graph came from the poisoned AOTAutograd entry, not a compile.
    assert {a["meta"]["aot_autograd_cache"] for a in res.value["artifacts"]} == {"hit"}
    for art in res.value["artifacts"]:
        report = verify_artifact(SPEC, art["path"], art["format"], device="cpu",
                                 timeout_s=scaled(600), memory_mb=6000)
        assert not report.ok
        assert "max abs error" in (report.error or ""), report.error


def per_block_spec(version: str, changed: int) -> JobSpec:
    return JobSpec.from_json({
        "name": "cache-blocks", "version": version,
        "model": {"entrypoint": "farm.zoo.stack:stack",
                  "kwargs": {"layers": 3, "width": 8, "distinct": True, "changed": changed}},
        "inputs": ["float32[2,8]"], "options": {"per_block": True}})


def test_a_per_block_rebuild_compiles_only_the_changed_layer(
        store: RedisCacheStore, build_tmp: Path) -> None:
    """A per_block build stores each block's function in the project's
    shared cache; the next version, with one of three distinct layers
    changed, gets the other two from it and compiles one. Both artifacts
    pass the fresh-process verification against eager, whose cache is empty:
    the kernels of the blocks that came from the cache ship inside the
    artifact."""
    prefix = f"farm:ccache:test-{uuid.uuid4().hex[:8]}"
    ns = namespace("cpu/blocks", "0", prefix=prefix)
    first, second = per_block_spec("1", -1), per_block_spec("2", 1)
    cold, res = build(store, ns, build_tmp / "v1", first)
    assert res.ok, res.error
    (art,) = res.value["artifacts"]
    assert art["meta"]["per_block"]["compiled"] == 3, art["meta"]
    if len(os.sched_getaffinity(0)) >= 2:
        # The three distinct layers were compiled side by side, in processes
        # forked by the sandboxed child (farm.build.blocks.precompile_in_parallel).
        assert art["meta"]["per_block"]["compiled_in_parallel"] == 3, art["meta"]
    cold.harvest()
    stored = {n for n in store.names(ns) if "/farm-blocks/" in n}
    assert len(stored) == 6, sorted(stored)  # each block under its exact and its shape key

    _, res = build(store, ns, build_tmp / "v2", second)
    assert res.ok, res.error
    (art2,) = res.value["artifacts"]
    assert {k: art2["meta"]["per_block"][k] for k in ("blocks", "compiled", "from_cache")} == {
        "blocks": 3, "compiled": 1, "from_cache": 2}, art2["meta"]
    for spec, a in ((first, art), (second, art2)):
        report = verify_artifact(spec, a["path"], a["format"], device="cpu",
                                 timeout_s=scaled(600), memory_mb=6000)
        assert report.ok, report


def aoti_spec(version: str, changed: int = -1) -> JobSpec:
    return JobSpec.from_json({
        "name": "cache-aoti", "version": version,
        "model": {"entrypoint": "farm.zoo.stack:stack",
                  "kwargs": {"layers": 2, "width": 16, "changed": changed}},
        "inputs": ["float32[2,16]"]})


@dataclasses.dataclass
class KeptPackage:
    spec: JobSpec
    ns: str
    entry: str  # its name in the store
    sha256: str


@pytest.fixture(scope="module")
def kept_package(redis_url: str, build_tmp_factory: Any) -> KeptPackage:
    """Version 1's AOTI package, compiled cold and harvested into a namespace."""
    store = RedisCacheStore(redis_url)
    ns = namespace("cpu/aoti", "0", prefix=f"farm:ccache:test-{uuid.uuid4().hex[:8]}")
    spec = aoti_spec("1")
    fill_header_store()  # the tests below build the same graph under the same key
    cache, res = build(store, ns, build_tmp_factory("aoti-cold") / "b", spec, aoti=True)
    assert res.ok, res.error
    (art,) = res.value["artifacts"]
    assert art["meta"]["package_cache"]["hit"] is False, art["meta"]
    cache.harvest()
    (entry,) = [n for n in store.names(ns) if "/farm-aoti/" in n]
    assert entry.endswith(f"/{art['meta']['package_cache']['key']}.pt2"), entry
    return KeptPackage(spec, ns, entry, art["meta"]["sha256"])


def test_a_new_version_of_the_same_graph_gets_its_aoti_package_from_the_cache(
        store: RedisCacheStore, kept_package: KeptPackage, build_tmp: Path) -> None:
    """AOTI packages are not cached by torch: without the farm's cache each
    new build key compiled its package cold. Version 2, the same graph, takes
    version 1's package: the same bytes a cold compile gave, and it passes
    the fresh-process verification."""
    spec = aoti_spec("2")
    _, res = build(store, kept_package.ns, build_tmp / "v2", spec, aoti=True)
    assert res.ok, res.error
    (art,) = res.value["artifacts"]
    assert art["meta"]["package_cache"]["hit"] is True, art["meta"]
    assert art["meta"]["sha256"] == kept_package.sha256
    report = verify_artifact(spec, art["path"], art["format"], device="cpu",
                             timeout_s=scaled(600), memory_mb=6000)
    assert report.ok, report


def test_a_poisoned_aoti_package_is_stopped_by_the_fresh_process_verification(
        store: RedisCacheStore, kept_package: KeptPackage, build_tmp: Path) -> None:
    """Another model's package (one layer SiLU instead of GELU: the same
    parameters, inputs and outputs, so it loads and runs) planted under
    version 1's key: the build takes it, and the verification in a fresh
    process against eager refuses it."""
    prefix = f"farm:ccache:test-{uuid.uuid4().hex[:8]}"
    _, res = build(store, namespace("cpu/other", "0", prefix=prefix), build_tmp / "other",
                   aoti_spec("1", changed=0), aoti=True)
    assert res.ok, res.error
    (other,) = res.value["artifacts"]
    poisoned = namespace("cpu/poisoned", "0", prefix=prefix)
    store.put(poisoned, kept_package.entry, Path(other["path"]).read_bytes())
    _, res = build(store, poisoned, build_tmp / "poisoned", kept_package.spec, aoti=True)
    assert res.ok, res.error
    (art,) = res.value["artifacts"]
    assert art["meta"]["package_cache"]["hit"] is True, art["meta"]
    assert art["meta"]["sha256"] == other["meta"]["sha256"]  # the planted bytes
    report = verify_artifact(kept_package.spec, art["path"], art["format"], device="cpu",
                             timeout_s=scaled(600), memory_mb=6000)
    assert not report.ok
    assert "max abs error" in (report.error or ""), report.error


def _poison_aot_entry(data: bytes) -> bytes:
    """The AOTAutograd entry (torch's pickle, from this test's own clean
    build) with POISON appended to the wrapper source it carries."""
    import pickle

    entry = pickle.loads(data)
    graph = entry.compiled_fw.result
    graph.source_code += POISON.decode()
    return pickle.dumps(entry)


# Appended to a generated Inductor wrapper: every output doubled.
POISON = b"""
_farm_test_call = call


def call(args):
    out = _farm_test_call(args)
    for t in out:
        t.mul_(2)
    return out
"""


def test_farm_cache_salt_disowns_a_targets_entries(api: Api) -> None:
    from registry.service.cache import cache_salt

    target = str(CPU)
    assert cache_salt(api.db, target) == "0"
    assert api.post("/v1/cache/salt", json={"target": target}).status_code == 403  # submit
    r = api.post("/v1/cache/salt", role="admin", json={"target": target})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["old_salt"] == "0" and first["salt"] != "0"
    second = api.post("/v1/cache/salt", role="admin", json={"target": target}).json()
    assert second["old_salt"] == first["salt"] != second["salt"]
    # What workers read at the start of each build, and its namespace.
    assert cache_salt(api.db, target) == second["salt"]
    assert namespace(target, second["salt"]) != namespace(target, first["salt"])
    got = api.get("/v1/cache/salt", role="admin", params={"target": target})
    assert got.json()["salt"] == second["salt"], got.text
    # Another target keeps its own salt.
    assert cache_salt(api.db, str(CPU_512)) == "0"
    bad = api.post("/v1/cache/salt", role="admin", json={"target": "cpu/isa=avx2"})
    assert bad.status_code == 422 and "farm targets" in bad.json()["detail"]
