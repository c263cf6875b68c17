"""Everyday commands as a user runs them: `farm` (``cli.main``, and a real
subprocess where the process boundary matters) and the Python client against
a real API server (uvicorn on a port) over real PostgreSQL and SQLite.

Rows are made through ``registry.service`` as the workers make them, so no
test here needs a compile; the fleet-node side with real builds is in
``test_everyday_node.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from farm.app import cli
from farm.core.specs import JobSpec
from farm.node.client import FarmClient
from farm.node.errors import FarmError, NotFoundError
from registry import auth, service
from registry.api import create_app
from registry.blobstore import BlobStore, open_blob_store
from registry.db import Database
from tests.integration.test_api import CPU, make_settings, name_key_of, spec_json
from tests.integration.test_api import make_artifact as _make_artifact

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "everyday-admin-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    db: Database
    store: BlobStore
    tmp: Path
    enqueued: list[str]
    name_key: Path

    def farm(self, *argv: str, token: str = ADMIN) -> tuple[int, str, str]:
        """``farm ARGV`` through ``cli.main`` in this process; (status, stdout, stderr)."""
        return run_cli(self.url, token, *argv)

    def ok(self, *argv: str, token: str = ADMIN) -> str:
        """``farm ARGV`` that must succeed; its stdout."""
        code, out, err = run_cli(self.url, token, *argv)
        assert code == 0, (argv, code, out, err)
        return out


def run_cli(url: str, token: str, *argv: str) -> tuple[int, str, str]:
    import io

    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("FARM_TOKEN")
    os.environ["FARM_TOKEN"] = token
    from farm.core.settings import get_settings

    get_settings.cache_clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(["--url", url, *argv])
            except SystemExit as exc:
                code = int(exc.code or 0)
    finally:
        if old is None:
            os.environ.pop("FARM_TOKEN", None)
        else:
            os.environ["FARM_TOKEN"] = old
        get_settings.cache_clear()
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def served(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The real API under uvicorn on a free port, auth on."""
    monkeypatch.setenv("CLIENT_CACHE_DIR", str(tmp_path / "node-cache"))
    monkeypatch.setenv("FARM_NODE_TARGET_CACHE", str(tmp_path / "node-target.json"))
    settings = make_settings(tmp_path, db_url, farm_admin_token=ADMIN)
    enqueued: list[str] = []
    app = create_app(settings, enqueue=enqueued.append, resolve_cache_s=0)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    db = Database(db_url)
    store = open_blob_store(settings.resolved_blob_store_url())
    try:
        yield Served(f"http://127.0.0.1:{port}", db, store, tmp_path, enqueued,
                     name_key_of(settings))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        db.dispose()


def make_artifact(served: Served, **kw: Any) -> dict[str, Any]:
    """An artifact as the workers make one, its version bound as the API binds
    a submission (so aliases can be set on it)."""
    return _make_artifact(served.db, served.store, name_key=served.name_key, **kw)


def _running_job(db: Database, *, name: str = "tiny", version: str = "1") -> str:
    spec = JobSpec.from_json(spec_json(name, version))
    job_id = service.submit_job(db, spec, targets=[CPU])
    service.start_trace(db, job_id)
    (d,) = service.record_trace(db, job_id, {"fingerprint": "a" * 64, "param_count": 10})
    assert service.begin_compile(db, d.build_key, worker_id="host:1",
                                 heartbeat_max_age_s=30).action == "run"
    return job_id


# --- jobs: a short id, a list, the stage, an exit status --------------------------


def test_status_takes_the_short_id_progress_shows(served: Served) -> None:
    job_id = _running_job(served.db)
    code, out, _ = served.farm("status", job_id[:8])
    assert code == 0, out
    assert job_id in out
    # Too short to name one job: a clear refusal, not a 404 for a job that exists.
    code, _, err = served.farm("status", "zz")
    assert code == 1 and "no job or model 'zz'" in err and "farm jobs" in err


def test_jobs_lists_newest_first_and_filters(served: Served) -> None:
    first = _running_job(served.db, version="1")
    second = service.submit_job(served.db, JobSpec.from_json(spec_json("other", "1")),
                                targets=[CPU])
    code, out, _ = served.farm("jobs", "--json")
    assert code == 0
    assert [j["id"] for j in json.loads(out)] == [second, first]
    code, out, _ = served.farm("jobs", "--state", "compiling")
    assert code == 0 and first in out and second not in out
    assert "running" in out  # the build's state, per target
    code, out, _ = served.farm("jobs", "--model", "other", "--json")
    assert [j["id"] for j in json.loads(out)] == [second]
    code, _, err = served.farm("jobs", "--model", "tinny")
    assert code == 1 and "did you mean 'tiny'" in err
    # The same through the Python client.
    with FarmClient(served.url, ADMIN) as c:
        assert [j["id"] for j in c.jobs(state="queued")] == [second]


def test_status_log_shows_the_stage_while_the_build_runs(served: Served) -> None:
    job_id = _running_job(served.db)
    view = service.job_view(served.db, job_id)
    key = view["builds"][0]["build_key"]
    service.set_build_stage(served.db, key, "compiling")
    service.set_build_stage(served.db, key, "verifying aoti")
    code, out, _ = served.farm("status", job_id, "--log")
    assert code == 0
    assert "running: verifying aoti" in out
    log_lines = [ln for ln in out.splitlines() if ln.strip().startswith("|")]
    assert any(ln.endswith("compiling") for ln in log_lines), out
    assert any(ln.endswith("verifying aoti") for ln in log_lines), out
    code, out, _ = served.farm("status", job_id, "--json")
    assert json.loads(out)["builds"][0]["stage"] == "verifying aoti"
    assert "verifying aoti" in served.ok("jobs")
    # Once the build is over, its state is what lists show, not its last stage.
    service.fail_compile(served.db, key, error="boom")
    out = served.ok("jobs")
    assert "verifying aoti" not in out and "failed" in out


def test_status_of_a_failed_job_exits_1(served: Served) -> None:
    spec = JobSpec.from_json(spec_json("tiny", "9"))
    job_id = service.submit_job(served.db, spec, targets=[CPU])
    # What a trace of mlp() with float32[8,63] (a wrong input spec) recorded.
    error = ("farm.build.trace.CaptureError: capture failed at farm/zoo/basic.py:42: "
             "RuntimeError when making fake tensor call: Dynamo failed to run FX node with "
             "fake tensors: call_function <built-in function linear>(*(FakeTensor(..., "
             "device='meta', size=(8, 63)), Parameter(FakeTensor(..., device='meta', "
             "size=(128, 64), requires_grad=True)), Parameter(FakeTensor(..., device='meta', "
             "size=(128,), requires_grad=True))), **{}): got RuntimeError('a and b must have "
             "same reduction dim, but got [8, 63] X [64, 128].')\nTraceback ...")
    service.fail_job(served.db, job_id, error=error)
    code, out, err = served.farm("status", job_id)
    assert code == 1, (out, err)
    assert f"job {job_id} failed" in err
    # The trace error once, not once more per build, and without the FakeTensor reprs.
    assert out.count("reduction dim") == 1, out
    assert "not built: the trace failed" in out
    assert "FakeTensor(" not in out
    assert "linear>(*(float32[8,63], param float32[128,64], param float32[128])" in out
    assert "check their shapes" in out


def test_wait_timeout_says_the_job_goes_on(served: Served) -> None:
    job_id = _running_job(served.db)
    code, _, err = served.farm("status", job_id[:8], "--wait", "--timeout", "0.5")
    assert code == 1
    assert "goes on on the farm" in err and f"farm status {job_id} --wait" in err


def test_ctrl_c_while_waiting_says_how_to_get_back(served: Served) -> None:
    """A real process and a real SIGINT: what a user's Ctrl-C does."""
    import signal

    job_id = _running_job(served.db)
    env = {**os.environ, "FARM_URL": served.url, "FARM_TOKEN": ADMIN}
    # With SIGINT's disposition of a terminal's foreground process: a suite
    # started in the background by a non-interactive shell (`.ci/run &`)
    # ignores SIGINT, every process it starts inherits that, and Python then
    # installs no KeyboardInterrupt handler (the CLI would rightly ignore
    # the signal, as a background job should).
    foreground = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "runpy.run_module('farm.app.cli', run_name='__main__', alter_sys=True)")
    p = subprocess.Popen([sys.executable, "-c", foreground, "status", job_id, "--wait"],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stderr is not None and p.stdout is not None
    # Once it is watching (its first progress line), interrupt it.
    first = p.stderr.readline()
    assert "job " in first, first
    p.send_signal(signal.SIGINT)
    out, rest = p.communicate(timeout=120)
    err = first + rest
    assert p.returncode == 130, (out, err)
    assert "goes on on the farm" in err and f"farm status {job_id} --wait" in err
    # And the job did go on.
    assert service.job_view(served.db, job_id)["state"] == "compiling"


# --- aliases: list, history, roll back, delete --------------------------------------


def test_alias_moves_are_kept_and_roll_back(served: Served) -> None:
    make_artifact(served, version="1")
    make_artifact(served, version="2", fingerprint="e" * 64)
    served.ok("alias", "set", "tiny", "prod", "1")
    out = served.ok("alias", "set", "tiny", "prod", "2")
    assert "was 1; roll back with `farm alias set tiny prod 1`" in out
    code, out, _ = served.farm("alias", "list", "tiny")
    assert code == 0
    assert "tiny@prod -> 2" in out
    history = out.split("history, newest first:")[1]
    assert history.index("1 -> 2") < history.index("set to 1"), out
    # The roll back the message suggested, then the alias deleted.
    assert served.farm("alias", "set", "tiny", "prod", "1")[0] == 0
    with FarmClient(served.url, ADMIN) as c:
        assert c.resolve("tiny", "prod", ["int64[1,16]"], target=CPU)["version"] == "1"
        assert c.aliases("tiny")["history"][0]["previous"] == "2"
    code, out, _ = served.farm("alias", "rm", "tiny", "prod")
    assert code == 0 and "it pointed at 1" in out
    code, out, _ = served.farm("alias", "list", "tiny", "--json")
    body = json.loads(out)
    assert body["aliases"] == []
    assert body["history"][0]["version"] is None and body["history"][0]["previous"] == "1"


def test_a_missing_alias_lists_the_existing_ones(served: Served) -> None:
    make_artifact(served, version="1")
    served.farm("alias", "set", "tiny", "prod", "1")
    served.farm("alias", "set", "tiny", "canary", "1")
    code, _, err = served.farm("resolve", "tiny@prdo", "-i", "int64[1,16]", "--target",
                               str(CPU))
    assert code == 1
    assert "did you mean 'prod'" in err
    assert "versions: 1" in err and "aliases: canary, prod" in err
    code, _, err = served.farm("alias", "rm", "tiny", "stable")
    assert code == 1 and "aliases: canary, prod" in err


# --- deletes -----------------------------------------------------------------------


def test_delete_a_version_then_it_builds_again(served: Served) -> None:
    art = make_artifact(served, version="1")
    make_artifact(served, version="2", fingerprint="e" * 64)
    served.farm("alias", "set", "tiny", "prod", "1")
    assert served.store.exists(art["digest"])
    code, out, _ = served.farm("delete", "version", "tiny@1")
    assert code == 0, out
    assert "versions: 1" in out and "aliases: prod" in out
    assert not served.store.exists(art["digest"])
    code, _, err = served.farm("resolve", "tiny@1", "-i", "int64[1,16]", "--target", str(CPU))
    assert code == 1 and "versions: 2" in err
    # The same program submitted again is built again, not stuck on the old claim.
    spec = JobSpec.from_json(spec_json("tiny", "1"))
    job_id = service.submit_job(served.db, spec, targets=[CPU])
    service.start_trace(served.db, job_id)
    dispatch = service.record_trace(served.db, job_id, {"fingerprint": "f" * 64})
    assert len(dispatch) == 1


def test_delete_refuses_while_jobs_build_unless_forced(served: Served) -> None:
    _running_job(served.db)
    code, _, err = served.farm("delete", "version", "tiny@1")
    assert code == 1 and "still build" in err and "--force" in err
    assert served.farm("delete", "version", "tiny@1", "--force")[0] == 0
    assert served.farm("jobs", "--json")[1].strip() == "[]"


def test_delete_model_and_artifact_need_admin(served: Served) -> None:
    a1 = make_artifact(served, version="1")
    a2 = make_artifact(served, name="other", version="1",
                       fingerprint="d" * 64)
    submit = auth.create_token(served.db, "ci", "submit")
    code, _, err = served.farm("delete", "model", "tiny", token=submit)
    assert code == 1 and "needs role 'admin'" in err
    code, out, _ = served.farm("delete", "artifact", f"sha256:{a2['digest']}")
    assert code == 0 and "deleted artifact" in out
    assert not served.store.exists(a2["digest"])
    code, _, err = served.farm("resolve", "other@1", "-i", "int64[1,16]", "--target", str(CPU))
    assert code == 1 and "no artifacts yet" in err
    code, out, _ = served.farm("delete", "model", "tiny")
    assert code == 0
    assert not served.store.exists(a1["digest"])
    code, out, _ = served.farm("models", "--json")
    assert [m["name"] for m in json.loads(out)] == ["other"]


# --- tokens, models ------------------------------------------------------------------


def test_token_list_and_revoke(served: Served) -> None:
    code, token, _ = served.farm("token", "create", "fleet", "--role", "read")
    assert code == 0
    code, out, _ = served.farm("token", "list")
    assert code == 0 and "fleet  read" in out
    assert token.strip() not in out
    with FarmClient(served.url, token.strip()) as c:
        assert c.models() == []
    code, out, _ = served.farm("token", "revoke", "fleet")
    assert code == 0 and "revoked 1 token" in out
    with FarmClient(served.url, token.strip()) as c, pytest.raises(FarmError, match="401"):
        c.models()
    code, out, _ = served.farm("token", "list", "--revoked", "--json")
    assert [t["revoked"] for t in json.loads(out) if t["name"] == "fleet"] == [True]
    code, _, err = served.farm("token", "revoke", "nobody")
    assert code == 1 and "no live token named 'nobody'" in err


def test_models_shows_kwargs(served: Served) -> None:
    for version, vocab in (("1", 64), ("2", 128)):
        spec = spec_json("tiny", version)
        spec["model"]["kwargs"] = {"vocab": vocab}
        service.submit_job(served.db, JobSpec.from_json(spec), targets=[CPU])
    code, out, _ = served.farm("models")
    assert code == 0
    assert '{"vocab":64}' in out and '{"vocab":128}' in out


# --- resolve: why a hit, what to do on a miss -------------------------------------------


def test_resolve_says_why_it_chose_the_artifact(served: Served) -> None:
    make_artifact(served, also=("aot_compile",))
    code, out, _ = served.farm("resolve", "tiny@1", "-i", "int64[1,16]", "--target", str(CPU))
    assert code == 0, out
    assert "why" in out
    assert "format aoti comes before aot_compile on cpu" in out
    assert "covers the requested int64[1,16]" in out
    with FarmClient(served.url, ADMIN) as c:
        why = c.resolve("tiny", "1", ["int64[1,16]"], target=CPU)["why"]
    assert any("verified" in w for w in why)


def test_a_shape_miss_suggests_a_dynamic_range(served: Served) -> None:
    make_artifact(served, inputs=("float32[8,64]",))
    code, _, err = served.farm("resolve", "tiny@1", "-i", "float32[32,64]", "--target",
                               str(CPU))
    assert code == 1
    assert "--input 'float32[8..32,64]'" in err, err


def test_unknown_model_gets_did_you_mean(served: Served) -> None:
    make_artifact(served, name="llama-1b")
    with FarmClient(served.url, ADMIN) as c, pytest.raises(NotFoundError,
                                                           match="did you mean 'llama-1b'"):
        c.resolve("llama1b", None, ["int64[1,16]"], target=CPU)


# --- fetch -o ---------------------------------------------------------------------------


def test_fetch_does_not_overwrite_without_force(served: Served) -> None:
    out = served.tmp / "model.pt2"
    out.write_bytes(b"mine")
    code, _, err = served.farm("fetch", "tiny@1", "-i", "int64[1,16]", "--target", str(CPU),
                               "-o", str(out))
    assert code == 2 and "exists; pass --force" in err
    assert out.read_bytes() == b"mine"


# --- no farm, readiness -------------------------------------------------------------------


def test_no_farm_running_says_how_to_start_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FARM_URL"}
    env["FARM_URL"] = f"http://127.0.0.1:{_free_port()}"
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", "models"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "farm serve --embedded" in r.stderr and "FARM_URL" in r.stderr


def test_readyz_needs_a_live_compile_worker(served: Served) -> None:
    r = httpx.get(f"{served.url}/readyz")
    assert r.status_code == 503
    assert "no compile worker is live" in r.json()["detail"]
    assert httpx.get(f"{served.url}/healthz").status_code == 200
    service.record_heartbeat(served.db, worker_id="host:1", kind="compile", queue=CPU.queue,
                             target=str(CPU))
    r = httpx.get(f"{served.url}/readyz")
    assert r.status_code == 200, r.text
    with FarmClient(served.url, ADMIN) as c:
        assert c.ready()["status"] == "ok"


def test_serve_prints_the_export_line(tmp_path: Path, db_url: str) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("one backend is enough for a line of output")
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "BLOB_STORE_URL": (tmp_path / "b").as_uri(),
           "FARM_HOME": str(tmp_path), "FARM_ADMIN_TOKEN": ADMIN, "BROKER_URL": "memory://"}
    p = subprocess.Popen([sys.executable, "-m", "farm.app.cli", "serve", "--port", str(port)],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert p.stdout is not None
        lines = [p.stdout.readline() for _ in range(2)]
        assert f"export FARM_URL=http://127.0.0.1:{port}" in "".join(lines), lines
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_cli_parses_every_new_command() -> None:
    parser = cli.build_parser()
    for argv in (["jobs", "--state", "failed", "--model", "m"], ["status", "abcd", "--wait"],
                 ["alias", "list", "m"], ["alias", "rm", "m", "prod"],
                 ["delete", "version", "m@1", "--force"], ["delete", "model", "m"],
                 ["delete", "artifact", "0" * 64], ["token", "list"],
                 ["token", "revoke", "fleet"]):
        assert callable(parser.parse_args(argv).func), argv



def test_embedded_farm_prints_its_url_once_it_can_take_a_job(served: Served) -> None:
    """``farm serve --embedded`` prints the URL and the export line only when
    ``/readyz`` passes: before, a submit right after it failed."""
    import io

    from farm.app.embedded import announce_when_ready
    from farm.core.settings import Settings

    out = io.StringIO()
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(announce_when_ready(
        served.url, Settings(farm_home=served.tmp), timeout_s=120, stream=out)))
    t.start()
    time.sleep(2)
    assert out.getvalue() == "", "announced before a compile worker was live"
    service.record_heartbeat(served.db, worker_id="host:1", kind="compile", queue=CPU.queue,
                             target=str(CPU))
    t.join(timeout=120)
    assert done == [True]
    assert f"ready on {served.url}" in out.getvalue()
    assert f"export FARM_URL={served.url}" in out.getvalue()


def test_piped_watch_says_it_is_alive_between_stages(served: Served,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile runs for minutes in one stage: piped output must not go silent."""
    from farm.app import commands

    monkeypatch.setattr(commands, "WATCH_HEARTBEAT_S", 1.0)
    job_id = _running_job(served.db)
    key = service.job_view(served.db, job_id)["builds"][0]["build_key"]
    service.set_build_stage(served.db, key, "compiling")
    code, _, err = served.farm("status", job_id, "--wait", "--timeout", "4")
    assert code == 1  # it stopped watching; the job goes on
    still = [ln for ln in err.splitlines() if "still," in ln]
    assert still and "compiling" in still[0], err
