"""The web dashboard (``/ui``): its authentication and escaping against the
API app on a real database, then the pages in a real browser (Debian's
chromium, headless, driven by playwright) against the session farm, where a
job's build really failed and another model really built."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import auth, service
from registry.api import create_app
from registry.api.dashboard import COOKIE
from tests.fixtures.farm import ADMIN_TOKEN, Farm
from tests.slowdown import scaled

from .test_api import ADMIN_TOKEN as API_ADMIN_TOKEN
from .test_api import make_artifact, make_settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# Debian's chromium, as it is: nothing downloaded, nothing phoning home.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ROOT / "test-output"
CPU = Target.parse("cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2")
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'


# --- authentication and escaping (the app in-process, on SQLite) ------------------


@pytest.fixture
def ui(tmp_path: Path, _sqlite_head_template: Path) -> Iterator[tuple[TestClient, Any]]:
    path = tmp_path / "farm.db"
    shutil.copyfile(_sqlite_head_template, path)
    url = f"sqlite:///{path}"
    app = create_app(make_settings(tmp_path, url), enqueue=lambda _: None)
    with TestClient(app, base_url="http://farm.test") as client:
        yield client, app.state.farm.db


def test_every_page_renders_for_a_reader(ui: tuple[TestClient, Any]) -> None:
    client, db = ui
    state = client.app.state.farm  # type: ignore[attr-defined]
    art = make_artifact(db, state.store, name="tiny", version="1")
    service.set_alias(db, "tiny", "prod", "1", actor="tester")
    failed = _failed_job(db)
    client.cookies.set(COOKIE, auth.create_token(db, "dash", "read"))
    pages = {
        "/ui/": ["tiny", failed[:12], "artifacts"],
        "/ui/models": ["tiny", "prod → 1", "1 (1)"],
        "/ui/models/tiny": ["farm.zoo.llama:tiny", "prod", art["job_id"][:12]],
        "/ui/models/tiny/versions/1": [str(CPU), art["digest"][:16], "none stored"],
        "/ui/models/tiny/versions/prod": [str(CPU), "(alias", art["digest"][:16]],
        f"/ui/artifacts/{art['digest']}": [f"sha256:{art['digest']}", "int64[1,16]"],
        f"/ui/jobs/{art['job_id']}": ["succeeded", art["digest"][:16], "2.5 s"],
        "/ui/jobs?state=failed": [failed[:12]],
    }
    for path, needles in pages.items():
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:2000])
        for needle in needles:
            assert needle in r.text, (path, needle)
    # A filter that matches nothing says so; a bad one says what is known.
    assert "No jobs." in client.get("/ui/jobs?state=partial").text
    bad = client.get("/ui/jobs?state=nonsense")
    assert bad.status_code == 422 and "known:" in bad.text
    css = client.get("/ui/static/dashboard.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_misses_and_coverage_pages_show_what_nodes_asked_for(
    ui: tuple[TestClient, Any],
) -> None:
    from datetime import datetime, timezone

    from registry.service import reports as report_service

    client, db = ui
    state = client.app.state.farm  # type: ignore[attr-defined]
    art = make_artifact(db, state.store, name="tiny", version="1")
    service.set_alias(db, "tiny", "prod", "1", actor="tester")
    other = "cpu/python=3.11.7/torch=2.14.0+cpu/isa=avx2/threads=2"
    now = datetime.now(timezone.utc)
    row = {"reported_at": now, "kind": "miss", "model": "tiny", "ref": "prod", "version": "1",
           "inputs": "int64[1,32]", "grad_mode": "inference", "target": str(CPU),
           "code": "shape", "reason": f"no artifact covers int64[1,32] {HOSTILE}",
           "node": "node-a", "seconds": 0.01}
    report_service.store_reports(db, [row, {**row, "node": "node-b"},
                                      {**row, "target": other, "inputs": "int64[1,16]",
                                       "code": "torch", "node": "node-c"},
                                      {**row, "kind": "load", "inputs": "int64[1,16]",
                                       "code": None, "reason": None,
                                       "digest": art["digest"]}])
    client.cookies.set(COOKIE, auth.create_token(db, "dash", "read"))

    page = client.get("/ui/misses")
    assert page.status_code == 200, page.text
    text = page.text
    # Two nodes' misses of one shape are one row counted twice; the load is not a miss.
    assert "<b>2</b>" in text and "int64[1,32]" in text and "node-b" in text
    assert other in text
    assert HOSTILE not in text and "&lt;script&gt;" in text
    assert client.get("/ui/misses?model=tiny&since=1h").status_code == 200
    assert client.get("/ui/misses?model=nosuch").status_code == 404
    bad = client.get("/ui/misses?since=3y")
    assert bad.status_code == 422 and "known:" in bad.text

    # A newer torch needs tiny@1 built again, for what nodes asked for and what prod serves.
    newer = "cpu/python=3.11.7/torch=2.14.0+cpu/isa=avx2/threads=2"
    planned = client.get("/ui/plan", params={"target": newer})
    assert planned.status_code == 200, planned.text
    assert "table class=\"plan\"" in planned.text and "alias prod" in planned.text
    assert "int64[1,16]" in planned.text and newer in planned.text
    assert "Nothing to build" not in planned.text
    assert client.get("/ui/plan").status_code == 200
    bad_target = client.get("/ui/plan", params={"target": "cpu/nonsense=1"})
    assert bad_target.status_code == 422 and "selector" in bad_target.text

    cov = client.get("/ui/models/tiny/coverage")
    assert cov.status_code == 200, cov.text
    body = cov.text
    assert str(CPU) in body and art["digest"] in body and "prod" in body
    # Not covered: the wider shape on the built target, and any shape on the newer torch.
    assert "int64[1,32]" in body and other in body
    one = client.get("/ui/models/tiny/coverage", params={"version": "1"})
    assert one.status_code == 200 and "every version" in one.text
    assert client.get("/ui/models/tiny/coverage", params={"version": "9"}).status_code == 404
    assert client.get("/ui/models/nosuch/coverage").status_code == 404


def _failed_job(db: Any) -> str:
    spec = JobSpec.from_json({"name": "evil", "version": "1",
                              "model": {"entrypoint": "farm.zoo.basic:mlp"},
                              "inputs": ["float32[2,8]"]})
    job_id = service.submit_job(db, spec, targets=[CPU], submitted_by="tester")
    service.fail_job(db, job_id, error=f"trace failed: {HOSTILE}", log_text=f"line 1\n{HOSTILE}")
    return job_id


def test_pages_without_a_token_show_the_sign_in_page_and_no_data(
    ui: tuple[TestClient, Any],
) -> None:
    client, db = ui
    job_id = _failed_job(db)
    for path in ("/ui/", "/ui/models", "/ui/misses", "/ui/models/evil/coverage", "/ui/plan",
                 "/ui/models/evil", f"/ui/jobs/{job_id}", "/ui/jobs",
                 f"/ui/artifacts/{'a' * 64}", "/ui/models/evil/versions/1"):
        r = client.get(path)
        assert r.status_code == 401, (path, r.status_code)
        assert 'name="token"' in r.text, path
        # Only the way back (the path asked for) is echoed; nothing the database holds.
        body = r.text.replace(path, "")
        assert "evil" not in body and job_id[:12] not in body, path
        assert "trace failed" not in body and "tester" not in body, path
        assert r.headers["www-authenticate"] == "Bearer"
    # A wrong token, by cookie or by header, is no better.
    for cookie, headers in (("farm_nope", {}), (None, {"Authorization": "Bearer nope"})):
        client.cookies.clear()
        if cookie:
            client.cookies.set(COOKIE, cookie)
        r = client.get(f"/ui/jobs/{job_id}", headers=headers)
        assert r.status_code == 401 and "invalid or revoked" in r.text
        assert "trace failed" not in r.text and "tester" not in r.text
    client.cookies.clear()
    # The sign-in page says where to go back to, but never off the dashboard.
    r = client.get("/ui/login", params={"next": "//evil.example/x"})
    assert 'value="/ui/"' in r.text


def test_sign_in_sets_an_http_only_strict_cookie_and_pages_escape_hostile_text(
    ui: tuple[TestClient, Any],
) -> None:
    client, db = ui
    job_id = _failed_job(db)
    r = client.post("/ui/login", content="token=wrong&next=/ui/",
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 401 and "invalid or revoked" in r.text
    assert COOKIE not in r.headers.get("set-cookie", "")
    # A form posted from another site is refused before the token is looked at.
    r = client.post("/ui/login", content=f"token={API_ADMIN_TOKEN}",
                    headers={"Content-Type": "application/x-www-form-urlencoded",
                             "Origin": "https://evil.example"})
    assert r.status_code == 403
    r = client.post("/ui/login", content=f"token={API_ADMIN_TOKEN}",
                    headers={"Content-Type": "application/x-www-form-urlencoded",
                             "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and "own page" in r.text

    read = auth.create_token(db, "dash-reader", "read")
    r = client.post("/ui/login", content=f"token={read}&next=/ui/jobs/{job_id}",
                    headers={"Content-Type": "application/x-www-form-urlencoded",
                             "Origin": "http://farm.test"},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{job_id}"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={read};")
    lowered = cookie.lower()
    assert "httponly" in lowered and "samesite=strict" in lowered and "path=/ui" in lowered

    page = client.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200, page.text
    assert "dash-reader (read)" in page.text
    # The log and the error are shown, as text: never as markup.
    assert HOSTILE not in page.text
    assert "&lt;script&gt;alert(&#34;pwned&#34;)&lt;/script&gt;" in page.text
    assert "<script" not in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp
    assert page.headers["cache-control"] == "no-store"

    # Unknown things are a 404 page, for a signed-in reader.
    assert client.get("/ui/models/nosuch").status_code == 404
    assert client.get("/ui/jobs/ffffffffffff").status_code == 404
    bad = client.get("/ui/artifacts/not-a-digest")
    assert bad.status_code == 422 and "sha256" in bad.text

    # The same pages answer a Bearer header (curl), without the cookie.
    client.cookies.clear()
    r = client.get("/ui/jobs", headers={"Authorization": f"Bearer {read}"})
    assert r.status_code == 200 and job_id[:12] in r.text

    # Signing out drops the cookie; a revoked token stops working.
    client.cookies.set(COOKIE, read)
    assert client.get("/ui/models").status_code == 200
    out = client.post("/ui/logout", follow_redirects=False)
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]
    auth.revoke_tokens(db, "dash-reader")
    client.app.state.farm.auth.forget()  # type: ignore[attr-defined]
    client.cookies.set(COOKIE, read)
    assert client.get("/ui/models").status_code == 401



# --- in a real browser, against the session farm ----------------------------------


def _chromium() -> str:
    """Debian's chromium, or a failure that says how to get it (never a skip:
    scripts/bootstrap.sh installs it, so its absence is a broken machine)."""
    path = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if path is None:
        pytest.fail("the dashboard's browser test needs Debian's chromium at /usr/bin/chromium: "
                    "run scripts/bootstrap.sh (apt-get install -y chromium)")
    return path


def _spec(name: str, entrypoint: str, *, options: dict[str, Any] | None = None,
          inputs: str = "float32[2,16]") -> dict[str, Any]:
    return {"name": name, "version": "1", "model": {"entrypoint": entrypoint, "kwargs": {}},
            "inputs": [inputs], "grad_mode": "inference", "targets": ["cpu"],
            "options": {"backend": "eager", **(options or {})}}


def test_the_dashboard_in_a_browser_shows_a_failed_builds_log_and_artifacts(
    farm: Farm, tmp_path: Path,
) -> None:
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    farm.wait_for_targets()
    stamp = str(int(time.time()))
    # Fails in its build: torch cannot save a guard on the decorator's closure
    # when told to keep every guard.
    bad = farm.submit(_spec(f"dash-broken-{stamp}", "tests.models.broken:decorated_forward_model",
                            options={"guard_filter": "keep-all"}))
    good_name = f"dash-mlp-{stamp}"
    good = farm.submit(_spec(good_name, "tests.models.broken:mlp"))
    bad_job = farm.wait_job(bad, timeout=300)
    good_job = farm.wait_job(good, timeout=300)
    assert bad_job["state"] == "failed", bad_job
    (failed_build,) = bad_job["builds"]
    reason = (failed_build["error"] or "").strip()
    assert failed_build["state"] == "failed" and reason, failed_build
    assert good_job["state"] == "succeeded", good_job
    digest = good_job["builds"][0]["artifacts"][0]["digest"]

    SCREENSHOTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="farm-dashboard-chromium-")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                profile, executable_path=executable, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000})
            try:
                page = browser.new_page()
                page.set_default_timeout(scaled(30) * 1000)
                # Straight to the job: the sign-in page comes first, then the job.
                r = page.goto(f"{farm.url}/ui/jobs/{bad}")
                assert r is not None and r.status == 401
                assert page.locator("input[name=token]").is_visible()
                assert reason.splitlines()[0] not in page.content()
                page.fill("input[name=token]", ADMIN_TOKEN)
                page.click("button[type=submit]")
                page.wait_for_url(f"**/ui/jobs/{bad}")
                # The failed build's reason and log, as the reader sees them.
                error_box = page.locator(".build-failed pre.log.error")
                assert error_box.is_visible()
                first_line = reason.splitlines()[0]
                assert first_line in error_box.inner_text()
                if failed_build["log"]:
                    log = page.locator(".build-failed details pre.log")
                    assert log.is_visible()  # open by default for a failed build
                    assert failed_build["log"].strip().splitlines()[-1] in log.inner_text()
                assert page.locator(".build-failed .state-failed").count() >= 1
                shot = tmp_path / "dashboard-failed-job.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-failed-job.png")

                # The good build's page says where its seconds went: the
                # worker's own stages and the compile child's account of its
                # own (graph check, Dynamo, ...), as the API returns them.
                timings = good_job["builds"][0]["timings"]
                assert {"compile child", "verify aot_compile", "store"} <= set(
                    timings["worker"]), timings
                assert {"child start", "graph check", "Dynamo", "other"} <= set(
                    timings["child"]), timings
                assert "seconds, compile child" in good_job["builds"][0]["log"]
                page.goto(f"{farm.url}/ui/jobs/{good}")
                table = page.locator(".build-succeeded table.timings")
                assert table.is_visible()
                shown = table.inner_text()
                for name in ("compile child", "verify aot_compile", "graph check", "Dynamo"):
                    assert name in shown, shown
                assert f"{timings['worker']['compile child']:.1f} s" in shown
                if timings.get("zygote"):  # it waited for its worker's build zygote to start
                    assert "build zygote start" in shown and "imports" in shown, shown
                shot = tmp_path / "dashboard-build-seconds.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-build-seconds.png")

                # The cookie is out of reach of page scripts.
                (c,) = [c for c in browser.cookies() if c["name"] == COOKIE]
                assert c["httpOnly"] and c["sameSite"] == "Strict" and c["path"] == "/ui"
                assert page.evaluate("document.cookie") == ""

                # Models -> the good model -> its version: artifacts per target.
                page.click("header nav >> text=Models")
                page.click(f"a:text-is('{good_name}')")
                page.wait_for_url(f"**/ui/models/{good_name}")
                page.click("table a:text-is('1')")
                page.wait_for_url(f"**/ui/models/{good_name}/versions/1")
                target = good_job["builds"][0]["target"]
                assert page.locator("section.target h2").first.inner_text() == target
                row = page.locator(f"a[href='/ui/artifacts/{digest}']")
                assert row.count() == 1
                assert "signed build statement" in page.locator("table.artifacts").inner_text()
                shot = tmp_path / "dashboard-artifacts.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-artifacts.png")

                # One artifact: its attestation's fields.
                row.click()
                page.wait_for_url(f"**/ui/artifacts/{digest}")
                text = page.locator("main").inner_text()
                assert f"sha256:{digest}" in text
                assert "https://torch-farm.dev/provenance/build/v1" in text
                assert "builder.keyid" in text and "verification" in text
                shot = tmp_path / "dashboard-artifact.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-artifact.png")

                # A node misses a wider batch, and another falls back to JIT on
                # the shape that is built: the coverage and misses pages show both.
                with farm.http() as c:
                    r = c.post("/v1/reports", json={"node": "dash-node", "reports": [
                        {"kind": "miss", "model": good_name, "ref": "1", "version": "1",
                         "inputs": ["float32[8,16]"], "target": target, "code": "shape",
                         "reason": "no artifact covers float32[8,16]"},
                        {"kind": "fallback", "model": good_name, "ref": "1", "version": "1",
                         "inputs": ["float32[2,16]"], "target": target, "code": "load",
                         "reason": "the artifact did not load"}]})
                    assert r.status_code == 202, r.text
                page.goto(f"{farm.url}/ui/models/{good_name}/coverage")
                uncovered = page.locator("table.uncovered")
                assert "float32[8,16]" in uncovered.inner_text()
                assert "float32[2,16]" in page.locator("section.coverage table").first.inner_text()
                # Covered is not served: both reports are counted, and linked.
                not_served = page.locator("p.not-served")
                assert "Nodes reported 2 request(s) of this version not served" in (
                    not_served.inner_text())
                not_served.locator("a").click()
                page.wait_for_url(f"**/ui/misses?model={good_name}&since=")
                listed = page.locator("table.misses").inner_text()
                assert "the artifact did not load" in listed and "float32[8,16]" in listed
                shot = tmp_path / "dashboard-coverage.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-coverage.png")
                # The overview's count is the misses page's total, one click away.
                page.click("header nav >> text=Overview")
                card = page.locator("div.card.misses")
                count = card.locator("b").inner_text()
                card.locator("a").click()
                page.wait_for_url("**/ui/misses?since=24h")
                assert page.locator("p.total b").inner_text() == count
                misses = page.locator("table.misses").inner_text()
                assert "no artifact covers float32[8,16]" in misses

                # Signing out leaves nothing readable.
                page.click("header button[type=submit]")
                page.wait_for_url("**/ui/login")
                r = page.goto(f"{farm.url}/ui/jobs/{bad}")
                assert r is not None and r.status == 401
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    print(f"dashboard screenshots: {SCREENSHOTS}/dashboard-*.png (and {tmp_path})")
