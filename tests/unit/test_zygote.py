"""Build children forked from a warm, sandboxed zygote (farm.build.zygote):
what one child leaves behind never reaches the next, and a zygote that
cannot vouch for that is replaced. Real bubblewrap sandboxes, real forks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.build import zygote
from farm.build.isolation import Isolation
from farm.build.sandbox import isolation_unavailable, run_isolated
from farm.core.cpu_isa import isa_check_env

pytestmark = pytest.mark.skipif(isolation_unavailable() is not None,
                                reason="no bubblewrap sandbox on this machine")

PROBE = '''
import os, subprocess, time

def plant(p):
    with open("/tmp/planted", "w") as f:
        f.write("from the last build")
    try:
        os.makedirs("/dev/shm/x", exist_ok=True)
    except OSError:
        pass  # bubblewrap's /dev/shm may not be writable at all
    return os.getpid()

def look(p):
    parent = os.getppid()
    def can(path):
        try:
            with open(path, "rb") as f:
                f.read(16)
            return True
        except OSError:
            return False
    return {"planted": os.path.exists("/tmp/planted") or os.path.exists("/dev/shm/x"),
            "parent_environ": can(f"/proc/{parent}/environ"),
            "parent_mem": can(f"/proc/{parent}/mem"),
            "uid": os.getuid(), "env": os.environ.get("ZYGOTE_TEST"),
            "torch_loaded": "torch" in __import__("sys").modules}

def daemon(p):
    # A real daemon: it leaves the child's process tree (double fork).
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    os.wait()
    return os.getpid()

def helper(p):
    # A helper the child started and did not stop (as Inductor's compile pool).
    import subprocess
    return subprocess.Popen(["sleep", "600"]).pid

def late_daemon(p):
    # Ends just inside its time limit, leaving a daemon that goes by itself
    # within the zygote's grace for leftovers (farm.build.zygote).
    time.sleep(p["sleep_s"])
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(p["linger_s"])
        os._exit(0)
    os.wait()
    return os.getpid()

def hang(p):
    time.sleep(600)

def compiled_before(p):
    import sys
    from torch._dynamo.utils import counters
    # Imported by an Inductor compile's code generation only, not by the preload.
    return {"codegen_loaded": "torch._inductor.codegen.memory_planning" in sys.modules,
            "counters": {k: dict(v) for k, v in counters.items() if v}}

def refused(p):
    # What torch says when a fork's parent started the CUDA driver.
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA "
                       "with multiprocessing, you must use the 'spawn' start method")
'''


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "code"
    d.mkdir()
    (d / "zprobe.py").write_text(PROBE)
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    zygote.ZYGOTES.stop_all()
    yield d
    zygote.ZYGOTES.stop_all()


def run(probe: Path, fn: str, *, as_a_worker: bool = True, **kw: object) -> object:
    """``zprobe:fn`` in a sandboxed child; ``as_a_worker``: with what a
    worker hands its children about the ISA (``isa_check_env``: a zygote
    started without it runs Inductor's ISA test compiles, ten g++ runs, at
    its start), else with nothing but the test's variable (a fresh child
    then imports no torch at all)."""
    env = {**(isa_check_env() if as_a_worker else {}), "ZYGOTE_TEST": "1"}
    res = run_isolated(f"zprobe:{fn}", {}, timeout_s=float(kw.pop("timeout_s", 120)),
                       memory_mb=3000, import_paths=[probe], isolation=Isolation(),
                       env_extra=env)
    return res


def zygote_pid() -> int:
    (z,) = zygote.ZYGOTES._by_key.values()
    return z.host_pid


def test_children_fork_from_one_zygote_and_see_nothing_of_each_other(probe: Path) -> None:
    first = run(probe, "plant")
    assert first.ok, (first.error, first.stderr_tail)
    pid = zygote_pid()
    seen = run(probe, "look")
    assert seen.ok, (seen.error, seen.stderr_tail)
    # The first child waited for the zygote's start, and its result says
    # where that went; the second did not wait.
    start = first.zygote_start
    assert start["total"] >= start["imports"] > 0, start
    assert seen.zygote_start == {}
    assert zygote_pid() == pid  # the same warm zygote served both
    # Its start, measured by the worker from its request to the child's first line.
    assert seen.warm and 0 <= seen.stages["child start"] < seen.wall_s, seen.stages
    (z,) = zygote.ZYGOTES._by_key.values()
    assert not z.dirty  # and vouched for its sandbox after each child
    # Where its start went, as it measured it (the worker logs it).
    assert z.start_phases["imports"] > 0 and "CUDA fork check" in z.start_phases
    v = seen.value
    assert v["torch_loaded"] and v["env"] == "1"
    assert not v["planted"], v  # /tmp and /dev/shm emptied between children
    # Not dumpable: the zygote's environment and memory are closed to its children.
    assert not v["parent_environ"] and not v["parent_mem"], v
    if os.geteuid() == 0:  # the zygote's own leased uid (farm.build.uid_slots)
        assert v["uid"] == z.uid and z.uid in range(60100, 60100 + 64), (v["uid"], z.uid)


def test_a_process_left_behind_retires_the_zygote(probe: Path) -> None:
    res = run(probe, "daemon")
    assert res.ok, (res.error, res.stderr_tail)
    (z,) = zygote.ZYGOTES._by_key.values()
    assert z.dirty
    old = z.host_pid
    seen = run(probe, "look")
    assert seen.ok and zygote_pid() != old
    # The daemon went with its sandbox.
    assert not Path(f"/proc/{old}").exists()


def test_a_childs_own_helper_processes_end_with_it_and_the_zygote_serves_on(
        probe: Path) -> None:
    res = run(probe, "helper")
    assert res.ok, (res.error, res.stderr_tail)
    (z,) = zygote.ZYGOTES._by_key.values()
    assert not z.dirty
    pid = z.host_pid
    assert run(probe, "look").ok and zygote_pid() == pid


def test_the_zygotes_grace_for_leftovers_is_not_the_childs_time(probe: Path) -> None:
    """A child that ends 1 s inside its limit, leaving a daemon that is gone
    1.4 s later (inside the zygote's 2 s grace): its end counts when it
    ended, not after the grace, and the zygote serves on."""
    assert run(probe, "plant").ok  # the zygote's start is not the child's time either
    pid = zygote_pid()
    limit = 8.0
    res = run_isolated("zprobe:late_daemon", {"sleep_s": limit - 1.0, "linger_s": 1.4},
                       timeout_s=limit, memory_mb=3000, import_paths=[probe],
                       isolation=Isolation(), env_extra=isa_check_env())
    assert res.ok and res.warm, (res.error, res.stderr_tail)
    assert run(probe, "look").ok and zygote_pid() == pid


def test_a_time_out_kills_the_child_and_retires_the_zygote(probe: Path) -> None:
    res = run(probe, "hang", timeout_s=5)
    assert res.timed_out and not res.ok, res
    (z,) = zygote.ZYGOTES._by_key.values()
    assert z.dirty
    assert run(probe, "look").ok


def test_a_forked_child_refused_cuda_runs_again_fresh_and_later_ones_too(probe: Path) -> None:
    try:
        res = run(probe, "refused")
        # Run twice: forked (refused), then in a new interpreter; it is the
        # second one's result, and this worker process forks no more.
        assert not res.ok and not res.warm, res
        assert "forked subprocess" in (res.error or "")
        assert zygote.ZYGOTES.disabled and zygote.ZYGOTES._by_key == {}
        again = run(probe, "look", as_a_worker=False)
        assert again.ok and not again.warm and not again.value["torch_loaded"]
    finally:
        zygote.ZYGOTES.disabled = False


def test_off_starts_every_child_fresh(probe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.core.settings import get_settings

    monkeypatch.setenv("FARM_BUILD_ZYGOTE", "off")
    get_settings.cache_clear()
    try:
        res = run(probe, "look", as_a_worker=False)
        assert res.ok and not res.value["torch_loaded"]
        assert zygote.ZYGOTES._by_key == {}
    finally:
        monkeypatch.delenv("FARM_BUILD_ZYGOTE")
        get_settings.cache_clear()


@pytest.mark.parametrize("warm_up", [True, False], ids=["warm-up", "no warm-up"])
def test_a_warmed_zygotes_child_starts_with_the_compiler_used_and_no_counts_of_it(
        probe: Path, monkeypatch: pytest.MonkeyPatch, warm_up: bool) -> None:
    """FARM_ZYGOTE_WARM_UP: the zygote compiled a sample before serving, so
    its child finds Inductor's code generation imported, and none of the
    sample's cache misses or graphs in torch's counters (which the build
    reads, farm.build.compile_watch)."""
    from farm.core.settings import get_settings

    monkeypatch.setenv("FARM_ZYGOTE_WARM_UP", "1" if warm_up else "0")
    get_settings.cache_clear()
    try:
        res = run(probe, "compiled_before")
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert res.ok and res.warm, (res.error, res.stderr_tail)
    assert res.value == {"codegen_loaded": warm_up, "counters": {}}, res.value


def test_no_warm_up_compile_where_a_cuda_device_is_seen(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """On a GPU host the warm-up would start CUDA (Dynamo saves the CUDA RNG
    state around every frame), and the zygote would then serve nobody: it
    skips the compile there and says why."""
    import tempfile

    import torch

    # The warm-up's scratch cache dir goes with a zygote's private /tmp;
    # here it goes with the test's own directory.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    compiled: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiled.append(a))
    zygote.warm_up_compiler()
    assert compiled == []
    assert "no warm-up compile on a host with a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiled.append(a) or (lambda x: x))
    zygote.warm_up_compiler()
    assert len(compiled) == 1  # a host without one compiles its sample


def test_a_zygotes_account_of_its_start_is_kept_only_within_what_the_worker_measured(
        ) -> None:
    reported = {"imports": 3.2, "ISA pick": 99.0, "CUDA fork check": float("nan"),
                "warm-up compile": True, "x" * 50: 1.0, "optional imports": -1}
    assert zygote.kept_phases(reported, total_s=10.0) == {"imports": 3.2}
    assert zygote.kept_phases(["imports", 3.2], total_s=10.0) == {}


def test_the_wipe_keeps_mount_points_and_their_parents(tmp_path: Path) -> None:
    """bubblewrap makes a bind's missing parents on the private /tmp (a
    checkout under /tmp): emptying /tmp must step around them."""
    mount = tmp_path / "ci" / "checkout" / "farm"
    mount.mkdir(parents=True)
    (mount / "kept.py").write_text("")
    (tmp_path / "ci" / "planted").write_text("x")
    (tmp_path / "other" / "deep").mkdir(parents=True)
    assert zygote._wipe(str(tmp_path), {str(mount)})
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "ci", "ci/checkout", "ci/checkout/farm", "ci/checkout/farm/kept.py"]
