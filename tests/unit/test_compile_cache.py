"""farm.build.compile_cache without services: namespaces, entry names, and
what a harvest takes from a build directory the sandboxed child wrote."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.build.compile_cache import (
    CacheSession,
    DirCacheStore,
    RedisCacheStore,
    namespace,
    open_store,
    valid_entry,
)

A = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"
B = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=1"


def test_namespaces_differ_by_target_salt_and_prefix() -> None:
    names = {namespace(A, "0"), namespace(B, "0"), namespace(A, "1"),
             namespace(A, "0", prefix="other"), namespace(A, "0", model="mlp"),
             namespace(A, "0", model="mlp2")}
    assert len(names) == 6


def test_entry_names_from_the_store_cannot_leave_the_build_directory() -> None:
    assert valid_entry("inductor/ab/cabc.so")
    assert valid_entry("triton/XYZ/kernel.cubin")
    for bad in ("inductor/../x", "inductor//x", "/etc/passwd", "keys/x", "inductor/.hidden",
                "inductor", "inductor/a b"):
        assert not valid_entry(bad), bad


def test_harvest_takes_new_plain_files_only(tmp_path: Path) -> None:
    store = DirCacheStore(tmp_path / "store")
    ns = namespace(A, "0")
    store.put(ns, "inductor/aa/old.so", b"old")
    build = tmp_path / "build"
    cache = CacheSession(store, ns, build)
    assert cache.prefill() == 1
    assert (build / "inductor-cache/aa/old.so").read_bytes() == b"old"
    ind = build / "inductor-cache"
    (ind / "bb").mkdir()
    (ind / "bb/new.so").write_bytes(b"new")
    (ind / "bb/k.best_config").write_text("{}")
    (ind / "locks").mkdir()
    (ind / "locks/x").write_text("")
    secret = tmp_path / "builder-key.pem"
    secret.write_text("PRIVATE")
    os.symlink(secret, ind / "bb/link.so")
    os.link(secret, ind / "bb/hard.so")
    (build / "triton-cache/H").mkdir(parents=True)
    (build / "triton-cache/H/k.cubin").write_bytes(b"cubin")
    assert cache.harvest() == 2
    assert store.names(ns) == {"inductor/aa/old.so", "inductor/bb/new.so", "triton/H/k.cubin"}
    # Entries never change once written: the first writer's bytes stay.
    assert not store.put(ns, "inductor/bb/new.so", b"other")
    assert dict(store.entries(ns))["inductor/bb/new.so"] == b"new"


def test_the_store_goes_where_farm_compile_cache_url_says(tmp_path: Path) -> None:
    home = tmp_path / "home"
    url = "redis://127.0.0.1:6379/0"
    # Unset: the farm's own Redis, else a directory under FARM_HOME.
    assert isinstance(open_store(mode="on", redis_url=url, farm_home=home), RedisCacheStore)
    own = open_store(mode="on", redis_url="", farm_home=home)
    assert isinstance(own, DirCacheStore) and own.root == home / "compile-cache"
    # Set: a directory several farms share, or a Redis of its own.
    shared = open_store(mode="on", redis_url=url, farm_home=home, url=str(tmp_path / "shared"))
    assert isinstance(shared, DirCacheStore) and shared.root == tmp_path / "shared"
    assert isinstance(open_store(mode="redis", redis_url="", farm_home=home,
                                 url="redis://127.0.0.1:6379/3"), RedisCacheStore)
    assert open_store(mode="off", redis_url=url, farm_home=home, url=str(tmp_path)) is None
    with pytest.raises(ValueError, match="a redis:// URL for redis"):
        open_store(mode="redis", redis_url=url, farm_home=home, url=str(tmp_path))
    with pytest.raises(ValueError, match="does not fit"):
        open_store(mode="dir", redis_url=url, farm_home=home, url=url)


def test_scoped_namespaces_are_per_project_by_default() -> None:
    from farm.build.compile_cache import scoped_namespace

    a = scoped_namespace(A, "0", project="team-a", model="m")
    assert a == scoped_namespace(A, "0", scope="project", project="team-a", model="other")
    assert a != scoped_namespace(A, "0", project="team-b", model="m")
    # default is a project too, not the old target-wide namespace.
    assert scoped_namespace(A, "0") == scoped_namespace(A, "0", project="default")
    assert scoped_namespace(A, "0") != namespace(A, "0")
    assert scoped_namespace(A, "0", scope="target", project="team-a") == namespace(A, "0")
    assert scoped_namespace(A, "0", scope="model", model="m") == namespace(A, "0", model="m")
    with pytest.raises(ValueError, match="project, model, target"):
        scoped_namespace(A, "0", scope="everyone")
