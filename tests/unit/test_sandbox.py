"""farm.build.sandbox: a child's time-out, crash, memory-out, exception and
environment, each observed from the parent. The child targets are the
underscore functions below (the child imports this module)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from typing import Any

import psutil
import pytest

from farm.build.child_env import compilers_on_path, scrubbed_env, without_compilers
from farm.build.sandbox import run_isolated

HERE = "tests.unit.test_sandbox"

SECRETS = {
    "DATABASE_URL": "postgresql://farm:pw@db/farm",
    "REDIS_URL": "redis://redis:6379/0",
    "BROKER_URL": "redis://redis:6379/1",
    "BLOB_STORE_URL": "s3://bucket",
    "AWS_SECRET_ACCESS_KEY": "x",
    "AWS_ACCESS_KEY_ID": "y",
    "S3_ENDPOINT_URL": "http://minio:9000",
    "FARM_TOKEN": "t",
    "FARM_ADMIN_TOKEN": "a",
    "FARM_SIGNING_KEY": "/keys/farm.pem",
    "FARM_BUILDER_KEY": "/keys/builder.pem",
}


# --- child targets ------------------------------------------------------------------


def _echo(payload: dict[str, Any]) -> dict[str, Any]:
    print("hello from the child")
    return {"payload": payload, "pid": os.getpid(), "env": dict(os.environ)}


def _raise(payload: dict[str, Any]) -> None:
    def factory() -> None:
        raise ValueError(f"bad model: {payload['why']}")

    factory()


def _sleep_with_grandchild(payload: dict[str, Any]) -> None:
    gc = subprocess.Popen(["sleep", "300"])
    with open(payload["pidfile"], "w") as f:
        f.write(str(gc.pid))
    time.sleep(300)


def _abort(payload: dict[str, Any]) -> None:
    os.abort()


def _segfault(payload: dict[str, Any]) -> None:
    ctypes.string_at(0)


def _hog(payload: dict[str, Any]) -> None:
    chunks = []
    while True:
        chunks.append(bytearray(32 * 2**20))  # bytearray writes its pages: real RSS
        time.sleep(0.01)


def _not_json(payload: dict[str, Any]) -> object:
    return object()


# --- tests --------------------------------------------------------------------------


def test_value_and_stdout_come_back() -> None:
    res = run_isolated(f"{HERE}:_echo", {"x": [1, 2]}, timeout_s=60, memory_mb=2000)
    assert res.ok, res
    assert res.value["payload"] == {"x": [1, 2]}
    assert res.value["pid"] != os.getpid()
    assert "hello from the child" in res.stdout_tail
    assert res.exit_code == 0 and res.signal is None
    assert res.peak_rss_mb > 0 and res.wall_s > 0


def test_exception_comes_back_with_type_message_and_traceback() -> None:
    res = run_isolated(f"{HERE}:_raise", {"why": "no such layer"}, timeout_s=60, memory_mb=2000)
    assert not res.ok
    assert res.error_type == "ValueError"
    assert res.error == "bad model: no such layer"
    assert res.traceback and "in factory" in res.traceback and "ValueError" in res.traceback
    assert res.exit_code == 1 and not res.timed_out and not res.oom


def test_timeout_kills_the_whole_process_group(tmp_path: Any) -> None:
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    res = run_isolated(f"{HERE}:_sleep_with_grandchild", {"pidfile": str(pidfile)},
                       timeout_s=3, memory_mb=2000)
    assert time.monotonic() - t0 < 30
    assert not res.ok and res.timed_out and not res.oom
    assert res.signal in ("SIGTERM", "SIGKILL")
    assert "wall-clock" in (res.error or "")
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and time.monotonic() < deadline:
        try:
            if psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        if psutil.pid_exists(grandchild):
            pytest.fail(f"grandchild {grandchild} survived the time-out")


@pytest.mark.parametrize(("target", "sig"), [("_abort", "SIGABRT"), ("_segfault", "SIGSEGV")])
def test_crash_is_reported_with_its_signal(target: str, sig: str) -> None:
    res = run_isolated(f"{HERE}:{target}", {}, timeout_s=60, memory_mb=2000)
    assert not res.ok
    assert res.signal == sig
    assert res.exit_code is None and not res.timed_out and not res.oom
    # faulthandler's Python stack names the function that crashed.
    assert target in res.stderr_tail


def test_memory_limit_kills_the_child() -> None:
    res = run_isolated(f"{HERE}:_hog", {}, timeout_s=120, memory_mb=400)
    assert not res.ok and res.oom and not res.timed_out
    assert res.signal == "SIGKILL"
    assert res.peak_rss_mb > 400
    assert "memory" in (res.error or "")


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FARM_HARMLESS", "kept")
    res = run_isolated(f"{HERE}:_echo", {}, timeout_s=60, memory_mb=2000,
                       env_extra={"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})
    assert res.ok, res
    env = res.value["env"]
    leaked = sorted(set(SECRETS) & set(env))
    assert not leaked, f"secrets reached the child: {leaked}"
    assert env["FARM_HARMLESS"] == "kept"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/x"


def test_scrubbed_env_is_pure() -> None:
    env = scrubbed_env({**SECRETS, "PATH": "/bin", "MY_API_TOKEN": "z", "HOME": "/root"})
    assert env == {"PATH": "/bin", "HOME": "/root"}


def test_non_json_value_is_an_error() -> None:
    res = run_isolated(f"{HERE}:_not_json", {}, timeout_s=60, memory_mb=2000)
    assert not res.ok and res.error_type == "TypeError" and "not JSON" in (res.error or "")


def test_bad_target_is_an_error_in_the_child() -> None:
    res = run_isolated("tests.unit.no_such_module:f", {}, timeout_s=60, memory_mb=2000)
    assert not res.ok and res.error_type == "ModuleNotFoundError"
    with pytest.raises(ValueError):
        run_isolated("no-colon", {}, timeout_s=1, memory_mb=100)


def test_without_compilers_hides_every_compiler() -> None:
    env = without_compilers({"PATH": os.environ.get("PATH", ""), "CXX": "g++", "CC": "gcc"})
    assert compilers_on_path(env) == {}
    assert "CXX" not in env and "CC" not in env
    # Ordinary tools are still there.
    assert subprocess.run(["sleep", "0"], env=env).returncode == 0


def test_a_model_too_big_for_the_build_gpu_fails_early_with_numbers() -> None:
    import torch

    from farm.build.compile_common import ModelDoesNotFit
    from farm.build.weightless import check_fits, tensor_bytes

    with torch.device("meta"):
        big = torch.nn.Linear(1024, 1024, dtype=torch.bfloat16)
    assert tensor_bytes(big) == (1024 * 1024 + 1024) * 2
    gib = 1024**3
    check_fits(10 * gib, free_bytes=100 * gib, total_bytes=140 * gib, device="cuda:0")
    expected = r"weights take 138\.0 GiB.*100\.0 of 140\.0 GiB free"
    with pytest.raises(ModelDoesNotFit, match=expected):
        check_fits(138 * gib, free_bytes=100 * gib, total_bytes=140 * gib, device="cuda:0")
