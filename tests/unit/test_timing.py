"""workers.timing: the visibility timeout comes from the limits of a task's
parts, and the parts without a limit of their own get one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from farm.core.settings import Settings
from registry.entities import FORMATS
from workers.timing import (
    FINISH_WAIT_S,
    DeadlineExceeded,
    compile_worst_case_s,
    deadline,
    trace_worst_case_s,
    visibility_timeout_s,
)


def test_the_default_visibility_outlasts_a_compile_with_every_verify_and_upload() -> None:
    s = Settings()
    worst = (
        s.farm_code_fetch_timeout_s
        + s.build_timeout_s
        + len(FORMATS) * (s.build_timeout_s + s.farm_upload_timeout_s)
        + FINISH_WAIT_S
    )
    assert compile_worst_case_s(s) == worst
    assert visibility_timeout_s(s) > worst > trace_worst_case_s(s)
    # The old value (twice the build timeout plus 300 s) was shorter than a
    # compile followed by two verifications at their limits.
    assert visibility_timeout_s(s) > 3 * s.build_timeout_s


def test_it_follows_the_limits_and_an_explicit_value_wins() -> None:
    small = Settings(
        build_timeout_s=10, trace_timeout_s=5, farm_code_fetch_timeout_s=1, farm_upload_timeout_s=1
    )
    assert visibility_timeout_s(small) < visibility_timeout_s(Settings())
    long_trace = Settings(build_timeout_s=10, trace_timeout_s=100_000)
    assert visibility_timeout_s(long_trace) > 100_000
    assert visibility_timeout_s(Settings(farm_visibility_timeout_s=7)) == 7


def test_the_celery_app_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.core import settings as settings_mod
    from workers.app import make_celery

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("BUILD_TIMEOUT_S", "123")
    settings_mod.get_settings.cache_clear()
    try:
        app = make_celery()
        s = settings_mod.get_settings()
        assert app.conf.broker_transport_options["visibility_timeout"] == visibility_timeout_s(s)
        assert app.conf.worker_send_task_events and app.conf.task_send_sent_event
        # Sent as they happen, not held until a solo worker's task ends.
        from workers.task_events import SendTaskEventsAtOnce

        assert SendTaskEventsAtOnce in app.steps["consumer"]
    finally:
        settings_mod.get_settings.cache_clear()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_a_request_to_a_silent_server_is_cut_at_its_limit(silent_endpoint: str) -> None:
    import urllib3

    # urllib3 alone would wait its read timeout and retry; and a TimeoutError
    # raised by the alarm would be taken for a socket timeout and retried too.
    pool = urllib3.PoolManager(retries=urllib3.Retry(total=5, read=5))
    with (
        pytest.raises(DeadlineExceeded, match="fetching the code took longer than 1 s"),
        deadline(1, "fetching the code"),
    ):
        pool.request("GET", f"{silent_endpoint}/code", timeout=60)
    # And the task retries it, as any infrastructure error.
    from workers.tasks import RETRYABLE

    assert issubclass(DeadlineExceeded, RETRYABLE)


def test_a_hanging_install_is_cut_at_its_limit() -> None:
    import subprocess
    import sys

    with pytest.raises(DeadlineExceeded), deadline(1, "installing the code's wheels"):
        subprocess.run([sys.executable, "-c", "import time; time.sleep(600)"], check=True)


def test_no_deadline_outside_the_main_thread() -> None:
    out: list[str] = []

    def run() -> None:
        with deadline(0.01, "x"):
            out.append("ran")

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out == ["ran"]
