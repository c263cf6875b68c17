"""The embedded farm: one machine, no services.

SQLite for metadata, a local directory for blobs and SQLite again as the
Celery broker (kombu's SQLAlchemy transport), all under ``FARM_HOME``; real
Celery worker processes (one trace worker, one compile worker for this
machine's CPU target) run beside the API and stop with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from farm.core.settings import Settings, get_settings

log = logging.getLogger(__name__)


ROOT_KEY_FILE = "root-key.pem"
# Re-signed at start when the embedded trust list expires sooner than this.
_RESIGN_WITHIN_DAYS = 30.0


def prepare(settings: Settings | None = None) -> Settings:
    """Create FARM_HOME, migrate the database and set up the embedded trust."""
    from registry.db import upgrade

    s = settings or get_settings()
    s.farm_home.mkdir(parents=True, exist_ok=True)
    upgrade(s.resolved_database_url())
    ensure_embedded_trust(s)
    return s


def ensure_embedded_trust(s: Settings) -> None:
    """The embedded farm's own keys: a root key, the API's name key and the
    local compile worker's builder key, all under FARM_HOME, enrolled and
    signed into a trust list. One machine holds every key here, so this is
    for a farm on one machine only (docs/security.md); a deployment keeps its
    root key offline and enrols each key with ``farm keys``."""
    from datetime import datetime, timedelta, timezone

    from farm.build.provenance import DEFAULT_KEY_FILE as BUILDER_KEY_FILE
    from farm.core import attest
    from farm.core.keys import load_or_create_signing_key, public_key_pem
    from registry.api.signer import default_key_path
    from registry.db import Database
    from registry.service import trust

    root = load_or_create_signing_key(s.farm_home / ROOT_KEY_FILE)
    root_pub = s.farm_home / (ROOT_KEY_FILE + ".pub")
    if not root_pub.exists():
        root_pub.write_text(public_key_pem(root))
    name_key = load_or_create_signing_key(
        Path(s.farm_name_key) if s.farm_name_key else default_key_path(s))
    builder = load_or_create_signing_key(
        Path(s.farm_builder_key or s.farm_home / BUILDER_KEY_FILE))
    db = Database(s.resolved_database_url())
    try:
        for name, role, key in (("embedded-api", attest.ROLE_NAMES, name_key),
                                ("embedded-worker", attest.ROLE_BUILDER, builder)):
            trust.enroll_key(db, name=name, role=role, public_key=public_key_pem(key),
                             enrolled_by="embedded")
        records = trust.list_keys(db)
        keys = [r.to_json() for r in records if r.revoked_at is None]
        revoked = [{"keyid": r.keyid, "reason": r.revoked_reason or ""}
                   for r in records if r.revoked_at is not None]
        latest = trust.latest_trust_list(db)
        if latest is not None:
            try:
                current = attest.verify_trust_list(latest[1], root.public_key())
                soon = datetime.now(timezone.utc) + timedelta(days=_RESIGN_WITHIN_DAYS)
                if (set(current.keys) == {k["keyid"] for k in keys}
                        and set(current.revoked) == {r["keyid"] for r in revoked}
                        and current.expires > soon):
                    return
            except attest.AttestationError as exc:
                log.warning("embedded trust list does not verify (%s); signing a new one", exc)
        version = (latest[0] if latest else 0) + 1
        envelope = attest.sign_trust_list(
            root, attest.trust_list_payload(version=version, keys=keys, revoked=revoked))
        trust.store_trust_list(db, envelope, root_keyid=attest.keyid(root), version=version,
                               uploaded_by="embedded")
        log.info("embedded trust list version %d signed by root key %s", version,
                 attest.keyid(root)[:16])
    finally:
        db.dispose()


def embedded_env(settings: Settings) -> dict[str, str]:
    """The environment that the API and the workers share."""
    env = dict(os.environ)
    env.setdefault("FARM_HOME", str(settings.farm_home))
    env.setdefault("DATABASE_URL", settings.resolved_database_url())
    env.setdefault("BROKER_URL", settings.resolved_broker_url())
    env.setdefault("BLOB_STORE_URL", settings.resolved_blob_store_url())
    # The API serves the root's public half for a local node to trust on
    # first use; the API and workers never need the root's private key.
    env.setdefault("FARM_ROOT_KEY", str(settings.farm_home / (ROOT_KEY_FILE + ".pub")))
    # The local compile worker's key, which prepare() made and enrolled: the
    # workers see DATABASE_URL set (above), so they cannot tell they are embedded.
    env.setdefault("FARM_BUILDER_KEY", str(settings.farm_builder_key or settings.farm_home
                                           / "builder-key.pem"))
    # One user's farm on one machine: isolate model code where bubblewrap and
    # namespaces allow, else build unisolated with a warning at every build,
    # rather than refuse to start (farm.build.sandbox).
    env.setdefault("FARM_SANDBOX", "auto")
    return env


# A worker that dies this soon after its start counts as crashing at start;
# its restarts back off (1, 2, 4, ... up to RESTART_MAX_S seconds).
RESTART_QUICK_S = 10.0
RESTART_MAX_S = 60.0


class WorkerSlot:
    """One embedded worker process, restarted by the supervisor when it dies.

    A job is not lost with it: tasks are acknowledged late, a lost worker's
    task goes back to the queue, and the sweep re-sends builds whose worker
    stopped beating.
    """

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path | None) -> None:
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.name = " ".join(argv[argv.index("worker") + 1 :])
        self.restarts = 0
        self._quick_failures = 0
        self._not_before = 0.0
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.started = time.monotonic()
        return proc

    def check(self, now: float) -> None:
        """Restart the process if it has exited (after its back-off)."""
        code = self.proc.poll()
        if code is None:
            return
        if self._not_before == 0.0:
            quick = now - self.started < RESTART_QUICK_S
            self._quick_failures = self._quick_failures + 1 if quick else 0
            delay = min(RESTART_MAX_S, 2.0 ** (self._quick_failures - 1)) if quick else 0.0
            log.warning("embedded %s worker exited with %s; restarting it in %.0f s",
                        self.name, code, delay)
            self._not_before = now + delay
        if now >= self._not_before:
            self._not_before = 0.0
            self.restarts += 1
            self.proc = self._spawn()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextmanager
def worker_processes(
    env: dict[str, str],
    *,
    devices: tuple[str, ...] = ("cpu",),
    log_dir: Path | None = None,
    supervise_every_s: float = 1.0,
) -> Iterator[list[WorkerSlot]]:
    """Start one trace worker and one compile worker per device, restart any
    that dies while the block runs, and stop them all on exit."""
    slots: list[WorkerSlot] = []
    stopping = threading.Event()

    def supervise() -> None:
        while not stopping.wait(supervise_every_s):
            for slot in slots:
                try:
                    slot.check(time.monotonic())
                except OSError as exc:  # cannot fork now: try again next round
                    log.error("could not restart the embedded %s worker: %s", slot.name, exc)

    supervisor = threading.Thread(target=supervise, name="farm-embedded-supervisor",
                                  daemon=True)
    try:
        seen: dict[str, int] = {}
        for kind, device in [("trace", None)] + [("compile", d) for d in devices]:
            argv = [sys.executable, "-m", "farm.app.cli", "worker", kind]
            if device:
                argv += ["--device", device]
            elif len(devices) > 1:
                # Several compile workers: trace as many jobs at once, so the
                # second waits for its trace no longer than the first.
                argv += ["--concurrency", str(min(4, len(devices)))]
            # A device named twice gets two compile workers (builds of one
            # target side by side on a big GPU host), each with its own log.
            stem = f"worker-{kind}{'-' + device if device else ''}"
            n = seen[stem] = seen.get(stem, 0) + 1
            name = f"{stem}{'-' + str(n) if n > 1 else ''}.log"
            slots.append(WorkerSlot(argv, env, log_dir / name if log_dir else None))
        supervisor.start()
        yield slots
    finally:
        stopping.set()
        if supervisor.is_alive():
            supervisor.join()
        for slot in slots:
            slot.stop()
        deadline = time.monotonic() + 15
        for slot in slots:
            slot.wait(deadline)


def run_embedded(host: str = "127.0.0.1", port: int = 8000) -> None:
    """`farm serve --embedded`: API in this process, workers beside it."""
    import uvicorn

    s = prepare()
    env = embedded_env(s)
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    if host in ("127.0.0.1", "localhost", "::1") and "FARM_AUTH" not in os.environ:
        # One user on one machine, bound to loopback: tokens would only get in the way.
        os.environ["FARM_AUTH"] = "false"
    get_settings.cache_clear()
    from registry.api.app import create_app

    # Which compile workers to start beside the API (FARM_EMBEDDED_DEVICES).
    devices = get_settings().embedded_devices()
    # uvicorn re-raises the SIGTERM it shut down on once it has restored the
    # handler it found: make that handler unwind this function, so the
    # workers below are stopped with the API rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    isolation = decide_isolation(env)
    with worker_processes(env, devices=devices, log_dir=s.farm_home / "logs"):
        print(f"torch-farm (embedded) starting on {url}  home={s.farm_home}  root key "
              f"{_root_keyid(s)[:16]}; {isolation}; waiting for its compile worker before "
              "taking jobs", flush=True)
        threading.Thread(target=announce_when_ready, args=(url, s), name="farm-ready",
                         daemon=True).start()
        uvicorn.run(create_app(), host=host, port=port, log_level="warning")


def decide_isolation(env: dict[str, str]) -> str:
    """Whether this farm's builds run isolated, decided once before its
    workers start, as the phrase its first line says. ``auto`` on a machine
    that cannot isolate (the GPU image ships no bubblewrap) becomes ``off``
    for the workers: the user reads it here, once, instead of in a warning
    buried in every build's log. ``on`` that cannot isolate refuses to start,
    as a production worker does."""
    from farm.build.sandbox import (
        SandboxUnavailable,
        configured_uid,
        isolation_unavailable,
        sandbox_mode,
    )

    try:
        mode = sandbox_mode(env.get("FARM_SANDBOX"))
    except SandboxUnavailable as exc:
        raise SystemExit(f"farm: error: {exc}") from None
    if mode == "off":
        return "builds run model code UNISOLATED (FARM_SANDBOX=off: for development only)"
    why = isolation_unavailable(configured_uid())
    if why is None:
        return "builds isolated (bubblewrap sandbox)"
    if mode == "on":
        raise SystemExit(f"farm: error: FARM_SANDBOX=on and this machine cannot isolate "
                         f"model code: {why}")
    env["FARM_SANDBOX"] = "off"
    return (f"builds run model code UNISOLATED: {why} (FARM_SANDBOX=on refuses to start "
            "instead)")


def _root_keyid(s: Settings) -> str:
    """The embedded farm's root key id: what a node pins (``farm trust show``)."""
    from farm.core import attest
    from farm.core.keys import load_public_key

    return attest.keyid(load_public_key(s.farm_home / (ROOT_KEY_FILE + ".pub")))


READY_TIMEOUT_S = 600.0


def announce_when_ready(url: str, settings: Settings, *, timeout_s: float = READY_TIMEOUT_S,
                        stream: Any = None) -> bool:
    """Print the URL (and the ``export FARM_URL`` line) once ``/readyz`` says the
    farm can take a job: a compile worker has started and beats. Printed
    earlier, a ``farm submit`` right after it failed with "no compile workers
    are live". Returns whether it got ready within ``timeout_s``."""
    import httpx

    out = stream or sys.stdout
    deadline = time.monotonic() + timeout_s
    why = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 200:
                print(f"torch-farm (embedded) ready on {url}\n"
                      f"  export FARM_URL={url}", file=out, flush=True)
                return True
            why = str(r.json().get("detail", r.text))
        except (httpx.HTTPError, ValueError) as exc:
            why = str(exc)
        time.sleep(0.5)
    print(f"torch-farm (embedded): not ready after {timeout_s:.0f} s ({why}); see the worker "
          f"logs in {settings.farm_home / 'logs'}", file=out, flush=True)
    return False
