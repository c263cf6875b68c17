"""farm.build.sandbox's isolation, observed from inside and outside the child:
uid, pid namespace, the parent's /proc, network, files, environment, limits;
and how FARM_SANDBOX decides (on refuses, auto and off warn).

Needs bubblewrap (scripts/bootstrap.sh installs it), like a build worker."""

from __future__ import annotations

import logging
import os
import socket
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.build import sandbox
from farm.build.isolation import (
    Isolation,
    SandboxUnavailable,
    worker_pythonpath,
)
from farm.build.sandbox import (
    build_isolation,
    check_worker_can_isolate,
    isolation_unavailable,
    run_isolated,
)
from farm.core.cpu_isa import isa_check_env
from tests.sandbox_required import require_sandbox


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    require_sandbox()


PROBE = textwrap.dedent('''
    import os, socket, time
    from pathlib import Path


    def look(p):
        out = {"uid": os.getuid(), "pid": os.getpid(), "env": dict(os.environ),
               "pids": sorted(int(x) for x in os.listdir("/proc") if x.isdigit())}
        out["parent_environ"] = _read(f"/proc/{p['parent']}/environ")
        out["pid1_environ"] = _read("/proc/1/environ")
        out["secret_file"] = _read(p["secret_file"])
        out["connect"] = {}
        for port in p["ports"]:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                out["connect"][str(port)] = "connected"
            except OSError as exc:
                out["connect"][str(port)] = type(exc).__name__
        out["writes"] = {d: _write(d) for d in p["write_dirs"]}
        out["home"] = os.path.expanduser("~")
        return out


    def _read(path):
        try:
            return "READ:" + Path(path).read_text(errors="replace")[:200]
        except OSError as exc:
            return type(exc).__name__


    def _write(d):
        try:
            (Path(d) / "probe.txt").write_text("x")
            return "wrote"
        except OSError as exc:
            return type(exc).__name__


    def hang(p):
        while True:
            time.sleep(1)


    def hog(p):
        keep = []
        while True:
            keep.append(bytearray(b"1" * (32 << 20)))
''')


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    d = tmp_path / "code"
    d.mkdir()
    (d / "isoprobe.py").write_text(PROBE)
    return d


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    value = f"planted-{uuid.uuid4().hex}"
    # Names no scrub rule knows: the allow-list keeps them out.
    monkeypatch.setenv("INNOCENT_LOOKING", value)
    monkeypatch.setenv("DATABASE_URL", f"postgresql://x:{value}@db/farm")
    yield value


def _listening_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_the_child_sees_nothing_of_the_worker(probe_dir: Path, tmp_path: Path,
                                              planted: str) -> None:
    secret = tmp_path / "signing-key.pem"
    secret.write_text(planted)
    build = tmp_path / "build"
    build.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    listener = _listening_port()  # a service on the host's loopback
    try:
        res = run_isolated(
            "isoprobe:look",
            {"parent": os.getpid(), "secret_file": str(secret),
             "ports": [listener.getsockname()[1], 5432, 6379],
             "write_dirs": [str(build), str(outside), str(probe_dir),
                            str(Path(os.__file__).parent)]},
            timeout_s=60, memory_mb=2000, import_paths=[probe_dir],
            isolation=Isolation(writable=(str(build),)))
    finally:
        listener.close()
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    v = res.value
    if os.geteuid() == 0:  # a uid of its own while it runs (farm.build.uid_slots)
        assert v["uid"] in range(60100, 60100 + 64), v["uid"]
    assert os.getpid() not in v["pids"] and len(v["pids"]) <= 3, v["pids"]
    assert v["parent_environ"] == "FileNotFoundError", v["parent_environ"]
    assert not v["pid1_environ"].startswith("READ:") or planted not in v["pid1_environ"]
    assert v["secret_file"] == "FileNotFoundError"
    assert set(v["connect"].values()) <= {"ConnectionRefusedError", "OSError"}, v["connect"]
    assert v["writes"][str(build)] == "wrote"
    assert (build / "probe.txt").exists()  # the one writable place, seen from the host
    assert v["writes"][str(outside)] == "FileNotFoundError"  # not even there
    assert v["writes"][str(probe_dir)] == "OSError"  # EROFS: the code pack is read-only
    assert v["writes"][str(Path(os.__file__).parent)] == "OSError"
    assert not (outside / "probe.txt").exists()
    assert planted not in repr(v["env"]), "a planted secret reached the child's environment"
    assert "DATABASE_URL" not in v["env"] and "INNOCENT_LOOKING" not in v["env"]
    assert not [k for k in v["env"] if k.startswith("FARM_") or k == "SANDBOX_MAX_PROCS"], v["env"]
    assert v["home"] != os.path.expanduser("~")


def test_the_workers_pythonpath_reaches_an_isolated_child(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A host whose farm dependencies come from PYTHONPATH (a GPU image's
    # packages outside any site directory): the verifier child imports them.
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "only_on_pythonpath.py").write_text(
        "import os, sys\n"
        "def where(p):\n"
        "    return {'file': __file__, 'path': os.environ['PYTHONPATH']}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(deps), "relative/dir", ""]))
    res = run_isolated("only_on_pythonpath:where", {}, timeout_s=60, memory_mb=2000,
                       isolation=Isolation(), warm=False)
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    assert res.value["file"] == str(deps / "only_on_pythonpath.py")
    entries = res.value["path"].split(os.pathsep)
    assert str(deps) in entries and "relative/dir" not in entries and "" not in entries
    # ... mounted read-only, like the rest of the Python installation.
    res = run_isolated("isoprobe:look", {"parent": 1, "secret_file": "/nonexistent", "ports": [],
                                         "write_dirs": [str(deps)]},
                       timeout_s=60, memory_mb=2000, import_paths=[_probe_code(tmp_path)],
                       isolation=Isolation(), warm=False)
    assert res.ok and res.value["writes"][str(deps)] == "OSError", res


def test_worker_pythonpath_keeps_absolute_directories_only(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    raw = os.pathsep.join([str(a), "", "rel", str(tmp_path / "missing"), str(b), str(a)])
    assert worker_pythonpath({"PYTHONPATH": raw}) == [str(a), str(b)]
    assert worker_pythonpath({}) == []


def _probe_code(tmp_path: Path) -> Path:
    d = tmp_path / "probe-code"
    d.mkdir(exist_ok=True)
    (d / "isoprobe.py").write_text(PROBE)
    return d


def test_limits_still_end_an_isolated_child(probe_dir: Path) -> None:
    # Each forks from a zygote of its own (the time-out retires the first):
    # with the ISA answers a worker gives its children (isa_check_env),
    # neither zygote compiles Inductor's ISA tests at its start.
    res = run_isolated("isoprobe:hang", {}, timeout_s=3, memory_mb=2000,
                       import_paths=[probe_dir], isolation=Isolation(),
                       env_extra=isa_check_env())
    assert res.timed_out and not res.ok, res
    res = run_isolated("isoprobe:hog", {}, timeout_s=120, memory_mb=400,
                       import_paths=[probe_dir], isolation=Isolation(),
                       env_extra=isa_check_env())
    assert res.oom and not res.ok, res
    assert 400 <= res.peak_rss_mb < 1400, res.peak_rss_mb


def test_an_exception_comes_back_from_an_isolated_child(probe_dir: Path) -> None:
    res = run_isolated("isoprobe:no_such_function", {}, timeout_s=60, memory_mb=2000,
                       import_paths=[probe_dir], isolation=Isolation(),
                       env_extra=isa_check_env())
    assert not res.ok and res.error_type == "AttributeError", res


def test_sandbox_modes(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert isolation_unavailable() is None  # bubblewrap works here
    assert build_isolation(mode="on", writable=("/tmp/x",)) == Isolation(writable=("/tmp/x",))
    sandbox._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="farm.build.sandbox"):
        assert build_isolation(mode="off", what="build abc") is None
        assert build_isolation(mode="off", what="build def") is None
    # Said once per worker process, not in every build's log.
    assert caplog.text.count("FARM_SANDBOX=off: builds run model code unisolated") == 1
    with pytest.raises(SandboxUnavailable, match="not one of"):
        build_isolation(mode="maybe")
    # Without bubblewrap: "on" refuses (a worker does not start), "auto" warns.
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    isolation_unavailable.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            check_worker_can_isolate("on")
        with pytest.raises(SandboxUnavailable, match="FARM_SANDBOX=off"):
            build_isolation(mode="on")
        caplog.clear()
        sandbox._warn_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="farm.build.sandbox"):
            assert build_isolation(mode="auto") is None
            check_worker_can_isolate("auto")
        assert caplog.text.count("unisolated") == 2
    finally:
        isolation_unavailable.cache_clear()


def test_a_worker_that_cannot_isolate_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH with no bubblewrap on it
    env = {"PATH": str(empty), "FARM_HOME": str(tmp_path), "FARM_SANDBOX": "on",
           "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "farm.app.cli", "worker", "trace"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "cannot isolate model code" in out.stderr, out.stderr[-2000:]
    assert "apt-get install -y bubblewrap" in out.stderr and "FARM_SANDBOX=off" in out.stderr


def test_the_start_probe_fails_a_sandbox_weaker_than_configured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A sandbox that lost its network namespace, its pid namespace and its
    # seccomp filter (a bubblewrap wrapper, a misconfigured host): the probe
    # child reaches the worker's loopback, shares its pids and may create
    # user namespaces, and the worker refuses to start.
    real = sandbox.bwrap_argv

    def weaker(*args: object, **kw: object) -> object:
        cmd = real(*args, **kw)  # type: ignore[arg-type]
        argv = cmd.argv
        i = argv.index("--seccomp")
        del argv[i:i + 2]
        argv.remove("--unshare-net")
        argv.remove("--unshare-pid")
        return cmd

    monkeypatch.setattr(sandbox, "bwrap_argv", weaker)
    isolation_unavailable.cache_clear()
    try:
        why = isolation_unavailable()
        assert why is not None and why.startswith("the sandbox is weaker than configured"), why
        assert "reached 127.0.0.1" in why and "pid namespace" in why, why
        assert "no seccomp filter" in why and "user namespace was not refused" in why, why
        with pytest.raises(SandboxUnavailable, match="weaker than configured"):
            check_worker_can_isolate("on")
    finally:
        isolation_unavailable.cache_clear()
        monkeypatch.undo()
    assert isolation_unavailable() is None  # the real sandbox passes every check


def test_the_probe_finds_the_workers_environment_in_a_readable_environ(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.build import isolation_probe

    monkeypatch.setenv("DATABASE_URL", "postgresql://farm:hunter2@db/farm")
    leaked = isolation_probe._entry_digest("DATABASE_URL", "postgresql://farm:hunter2@db/farm")
    ok = {"uid": 65534, "pid_ns": "pid:[1]", "connects": {"1": "ConnectionRefusedError"},
          "environs": {"2": [isolation_probe._entry_digest("PATH", os.environ["PATH"])]},
          "seccomp": "2", "unshare_errno": 1}
    assert isolation_probe.findings(ok, uids={65534}, child_env={"PATH": os.environ["PATH"]}) == []
    bad = {**ok, "environs": {"1": [leaked]}}
    (why,) = isolation_probe.findings(bad, uids={65534}, child_env={"PATH": os.environ["PATH"]})
    assert "/proc/1/environ" in why, why


def test_a_child_may_create_paths_beside_its_binds_under_tmp(tmp_path: Path) -> None:
    """Where a bind under /tmp needs parent directories, they are the child's
    sandbox /tmp to write in (a CUDA aot_compile artifact's load recreates its
    build's cache path there); nothing it makes there reaches the host."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "beside.py").write_text(textwrap.dedent('''
        import os


        def make(p):
            os.makedirs(os.path.join(p["parent"], "farm-build-x", "inductor-cache", "ab"))
            return sorted(os.listdir(p["parent"]))
    '''))
    build = tmp_path / "slot" / "build"
    build.mkdir(parents=True)
    res = run_isolated("beside:make", {"parent": str(build.parent)}, timeout_s=60,
                       memory_mb=2000, import_paths=[code],
                       isolation=Isolation(writable=(str(build),)), warm=False)
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    assert res.value == ["build", "farm-build-x"]
    assert sorted(p.name for p in build.parent.iterdir()) == ["build"]
