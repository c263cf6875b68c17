"""Shared fixtures live in tests/fixtures/, one module per real service."""

import atexit
import os
import random
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests import machine_caches, slowdown
from tests.slowdown import scaled

pytest_plugins = [
    "tests.fixtures.db",
    "tests.fixtures.s3",
    "tests.fixtures.farm",
    "tests.fixtures.faults",
    "tests.fixtures.slot",
    "tests.fixtures.node",
]

# Modules (and shared-farm groups, by their first module) longest first, by
# their seconds in one idle run of the suite (docs/testing.md): xdist hands
# out whole modules in collection order to whichever worker is free, so the
# long ones start at once and the short ones fill the end (a 140-s module
# handed out last ran alone for the run's last two minutes). Seconds, on the
# 2-core CI machine: the session farm's group about 580 (led by
# test_pipeline_recovery), the AOTI farm's about 450 (test_pipeline,
# test_architectures, then test_attestation, which revokes its farm's builder
# key in its last test), then each module's own. A module not listed runs
# after these, by name.
LONG_FIRST = (
    "test_pipeline_recovery", "test_pipeline", "test_architectures", "test_attestation",
    "test_netns", "test_faults", "test_zygote", "test_compile_cpu",
    "test_hostile_models", "test_embedded", "test_isa_checks", "test_everyday", "test_load",
    "test_sandbox_isolation", "test_fuzz_api", "test_api", "test_fake_weights", "test_byom",
    "test_precompiled_headers", "test_visibility", "test_compile_cache", "test_projects",
    "test_compile_options", "test_build_memory", "test_trace", "test_api_bad_input",
    "test_node_agent", "test_parametrized_build", "test_migrations",
)


# Modules that share a session-scoped farm, under its fixture's name: the
# scheduler below sends each group to one xdist worker as one unit, in
# collection order, so the farm starts once (``aoti_farm``,
# tests/fixtures/faults.py; ``farm``, tests/fixtures/farm.py). test_attestation
# revokes its farm's builder key in its last test, so it sorts after
# test_pipeline and test_architectures (LONG_FIRST).
SHARED_FARMS = {
    "tests/integration/test_pipeline.py": "aoti_farm",
    "tests/integration/test_architectures.py": "aoti_farm",
    "tests/integration/test_attestation.py": "aoti_farm",
    # The session ``farm``'s users (tests/fixtures/farm.py): one farm for the
    # run instead of one per xdist worker (an API, two workers and their
    # zygotes: about 45 CPU-s a start). test_pipeline_recovery, the longest,
    # sorts first (LONG_FIRST), so the group starts at once.
    **{f"tests/integration/{name}.py": "farm" for name in (
        "test_pipeline_recovery", "test_programs", "test_structured_inputs",
        "test_training", "test_tensor_parallel", "test_fake_weights_farm",
        "test_fleet_feedback", "test_everyday_node", "test_byom_wheels", "test_dashboard",
        "test_dashboard_workers",
        "test_hostile_results", "test_projects_farm", "test_readme")},
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadfile, with the files of one ``SHARED_FARMS`` group as one
    unit (xdist's own loadgroup needs a nodeid suffix pytest 9 ignores)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFarmScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_FARMS.get(path, path)

    return SharedFarmScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # Runs in the controller first, and xdist's workers inherit its
    # environment: what is set here is shared by the whole run.
    #
    # The per-machine caches of this test session, not the user's: shared
    # with the workers and children the tests start (tests/machine_caches.py).
    d = tempfile.mkdtemp(prefix="farm-test-machine-")
    machine_caches.set_defaults(d)
    # And the compile cache (farm.build.compile_cache) its farms share, as
    # several farms of one host can (FARM_COMPILE_CACHE_URL, a directory):
    # the suite's farms build the same small models, and each farm compiled
    # their kernels again (docs/testing.md, "How long it takes"). Builds still
    # verify in a fresh process with an empty cache; a test of the cache's own
    # keys and scopes passes a store of its own
    # (tests/integration/test_compile_cache.py, test_projects_cache.py).
    os.environ.setdefault("FARM_COMPILE_CACHE_URL", os.path.join(d, "compile-cache"))
    # Most farms a test starts build once or twice: a zygote's warm-up compile
    # (2 s of CPU each) costs them more than it saves (45 s of the suite on 2
    # cores, docs/testing.md). The farms that build many times keep the
    # default: the session's shared farm and the farm "as deployed by
    # default" (tests/fixtures/farm.py, faults.py); tests/unit/test_zygote.py
    # checks both settings.
    os.environ.setdefault("FARM_ZYGOTE_WARM_UP", "false")
    # Time limits in tests scale with this (tests/slowdown.py).
    slowdown.factor()
    # xdist workers take consecutive Redis databases from one random base,
    # so two workers of one run never flush each other's. (Not FARM_...: model
    # code run by the farm must not see anything named so.)
    os.environ.setdefault("TORCH_FARM_TEST_REDIS_BASE", str(random.randint(0, 14)))
    # Each test process compiles into an Inductor cache of its own (and the
    # farms and nodes it starts inherit it), as each machine of a fleet has
    # one. Set in each xdist worker (or the one process of -n 0), not in the
    # controller, whose environment the workers inherit; a user's own
    # setting stays.
    xdist_controller = (not os.environ.get("PYTEST_XDIST_WORKER")
                        and bool(getattr(config.option, "numprocesses", None)))
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and not xdist_controller:
        own = tempfile.mkdtemp(prefix="farm-test-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = own
        atexit.register(_remove_own, own, os.getpid())


def _remove_own(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a fork that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.path.stem
        return LONG_FIRST.index(module) if module in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the order within a module is kept
    # pytest-timeout's limit (pyproject's `timeout`, per test on the reference
    # machine) scales with the run's slowdown like every other limit here: a
    # farm test on a busy machine is slower, not hung.
    limit = scaled(float(config.getini("timeout")))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


def _slowdown_line() -> str:
    return (f"{slowdown.ENV}={os.environ[slowdown.ENV]} (time limits in tests are "
            f"multiplied by it; measured at start unless set)")


def pytest_report_header(config: pytest.Config) -> str:
    return _slowdown_line()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(_slowdown_line())


@pytest.fixture
def undo_compiler_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put back, after the test, what ``farm.build.toolchain.use_compiler``
    changes in this process: ``CXX`` (which every later farm and child of
    the test process would inherit), the recorded choice, and Inductor's own
    compiler (``_inductor_compiler_unchanged`` fails a test that leaves it)."""
    from torch._inductor import config

    from farm.build import toolchain

    for name in ("CXX", toolchain.CXX_BEFORE_CHOICE_ENV):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:  # set, then removed: monkeypatch then restores its absence
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)
    monkeypatch.setattr(toolchain, "_current", toolchain._current)
    saved = config.cpp.cxx
    yield
    config.cpp.cxx = saved


@pytest.fixture(autouse=True)
def _inductor_compiler_unchanged() -> Iterator[None]:
    """A test that leaves Inductor's C++ compiler changed in this process
    fails itself, and the compiler is put back: left at a test's fake one
    (which exits 0 and writes nothing), every later in-process compile of
    the worker failed to load its kernel ("cannot open shared object
    file"), a flake of whichever test ran next (docs/testing.md)."""
    import sys

    def current() -> object:
        config = sys.modules.get("torch._inductor.config")
        return None if config is None else config.cpp.cxx

    from farm.build import toolchain

    before, chosen_before = current(), toolchain.current_compiler()
    yield
    after = current()
    # The farm's first choice for this process (a test's first in-process
    # build makes it) is no leak: every later build there would make it too.
    # A compiler under the temp dir is a test's fake one, never a choice.
    chosen = toolchain.current_compiler()
    first_choice = (chosen_before is None and chosen is not None and after == (None, chosen)
                    and not chosen.startswith(tempfile.gettempdir()))
    if before is not None and after != before and not first_choice:
        sys.modules["torch._inductor.config"].cpp.cxx = before
        pytest.fail(f"the test left Inductor's compiler changed: {before!r} -> {after!r}; "
                    "restore torch._inductor.config.cpp.cxx when the test ends")


@pytest.fixture(autouse=True, scope="session")
def _headers_only_from_the_store() -> None:
    """Tests that compile in the test process itself get precompiled headers
    as build children do: from the session's store, never from torch's own
    header build (which, left on here, once failed a CI build with an
    IndexError from its hashing: its preprocessed file was not there, most
    likely a test's fake compiler left in Inductor's config,
    docs/testing.md)."""
    from farm.build import pch
    from farm.core import precompiled_headers

    precompiled_headers.install(pch.store_dir())
