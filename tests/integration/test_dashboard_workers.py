"""The dashboard's workers table (``/ui/workers``, and the overview's workers
part): per target, the compile tasks waiting in the broker, the live compile
workers, builds, failures and compile times, the same numbers ``/metrics``
exports. First the app in-process on real PostgreSQL and Redis, with a
backlog and a failure made on purpose; then the page in a real browser
(Debian's chromium, headless) against the session farm, after a build there
really failed."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import service
from tests.fixtures.farm import ADMIN_TOKEN, Farm
from tests.slowdown import scaled

from .test_api import CPU, _api, beat, make_artifact, spec_json
from .test_dashboard import CHROMIUM_ARGS, SCREENSHOTS, _chromium, _spec

pytestmark = pytest.mark.integration


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def cells(html: str, target: str) -> dict[str, str]:
    """The workers table's row of ``target``: column class -> text."""
    from html.parser import HTMLParser

    row: dict[str, str] = {}

    class Row(HTMLParser):
        inside = False
        column: str | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            a = dict(attrs)
            if tag == "tr":
                self.inside = a.get("data-target") == target
            elif tag == "td" and self.inside:
                self.column = (a.get("class") or "").split(" ")[0]
                row[self.column] = ""

        def handle_data(self, data: str) -> None:
            if self.inside and self.column:
                row[self.column] += data

        def handle_endtag(self, tag: str) -> None:
            if tag == "td":
                self.column = None

    Row().feed(html)
    return {k: v.strip() for k, v in row.items()}


@pytest.fixture
def broker(redis_url: str) -> Iterator[Any]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.flushdb()


def test_the_workers_table_shows_what_metrics_exports(
    db_url: str, tmp_path: Path, redis_url: str, broker: Any
) -> None:
    # A target with tasks waiting and no live worker: the row a reader must see.
    other = Target.parse(str(CPU).replace("isa=avx2", "isa=avx512"))
    # The backlog: 3 compile tasks for CPU, 2 for a target no worker serves,
    # 4 traces.
    broker.rpush(CPU.queue, *[b"{}"] * 3)
    broker.rpush(other.queue, *[b"{}"] * 2)
    broker.rpush("trace", *[b"{}"] * 4)
    gen = _api(db_url, tmp_path, broker_url="", redis_url=redis_url)
    api = next(gen)
    try:
        beat(api.db, CPU, worker="host-a:1")
        beat(api.db, CPU, worker="host-b:2")
        make_artifact(api.db, api.store)  # one succeeded build, 2.5 s of compile
        make_artifact(api.db, api.store, version="2", inputs=("int64[1,32]",))  # another
        failed = JobSpec.from_json(spec_json(version="3"))
        job_id = service.submit_job(api.db, failed, targets=[CPU])
        service.start_trace(api.db, job_id)
        (d,) = service.record_trace(api.db, job_id, {"fingerprint": "e" * 64, "param_count": 1})
        service.fail_compile(api.db, d.build_key, error="compile failed: out of memory")
        waiting = JobSpec.from_json(spec_json(version="4", targets=[str(other)]))
        job2 = service.submit_job(api.db, waiting, targets=[other])
        service.start_trace(api.db, job2)
        service.record_trace(api.db, job2, {"fingerprint": "d" * 64, "param_count": 1})

        page = api.client.get("/ui/workers", headers=api.h("read"))
        assert page.status_code == 200, page.text[:2000]
        row = cells(page.text, str(CPU))
        assert row == {
            "target": str(CPU),
            "workers": "2",
            "waiting": "3",
            "running": "0",
            "succeeded": "2",
            "failed": "1",
            "mean-compile": "2.5 s",
            "compile-total": "5.0 s (2 builds)",
        }, row
        # Tasks waiting and nobody to take them: the row is marked.
        orphan = cells(page.text, str(other))
        assert orphan["workers"] == "0" and orphan["waiting"] == "2", orphan
        assert f'data-target="{other}" class="state-failed"' in page.text
        assert 'Trace tasks waiting: <b class="trace-waiting">4</b>' in page.text
        assert "host-a:1" in page.text and "host-b:2" in page.text

        # The same numbers as the scrape.
        m = samples(api.client.get("/metrics").text)
        t = (("target", str(CPU)),)
        assert m[("farm_target_queue_depth", t)] == 3
        assert m[("farm_target_queue_depth", (("target", str(other)),))] == 2
        assert m[("farm_target_workers", t)] == 2
        assert m[("farm_target_builds_failed", t)] == 1
        assert m[("farm_target_compile_seconds_sum", t)] == 5.0
        assert m[("farm_target_compile_seconds_count", t)] == 2
        assert m[("farm_queue_depth", (("queue", "trace"),))] == 4

        # The overview shows the same table.
        overview = api.client.get("/ui/", headers=api.h("read"))
        assert cells(overview.text, str(CPU)) == row
    finally:
        gen.close()


def test_the_workers_table_says_when_the_broker_cannot_be_read(db_url: str, tmp_path: Path) -> None:
    from farm.core.net import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    gen = _api(db_url, tmp_path, broker_url="", redis_url=dead)
    api = next(gen)
    try:
        beat(api.db, CPU)
        make_artifact(api.db, api.store)
        page = api.client.get("/ui/workers", headers=api.h("read"))
        assert page.status_code == 200, page.text[:2000]
        assert "the broker cannot be read" in page.text
        row = cells(page.text, str(CPU))
        assert row["waiting"] == "n/a" and row["succeeded"] == "1", row
        m = samples(api.client.get("/metrics").text)
        assert m[("farm_broker_up", ())] == 0
    finally:
        gen.close()


def test_the_workers_page_in_a_browser_after_a_real_failure(farm: Farm, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    (worker,) = farm.wait_for_targets()
    target = worker["target"]
    t = (("target", target),)
    before = samples(httpx.get(f"{farm.url}/metrics", timeout=30).text)
    # Fails in its build (torch cannot save a guard on the decorator's closure
    # when told to keep every guard); the eager backend keeps it short.
    bad = farm.submit(
        _spec(
            f"workers-broken-{int(time.time())}",
            "tests.models.broken:decorated_forward_model",
            options={"guard_filter": "keep-all"},
        )
    )
    job = farm.wait_job(bad, timeout=300)
    assert job["state"] == "failed", job
    m = samples(httpx.get(f"{farm.url}/metrics", timeout=30).text)
    failed = int(m[("farm_target_builds_failed", t)])
    assert failed == int(before.get(("farm_target_builds_failed", t), 0)) + 1
    count = m[("farm_target_compile_seconds_count", t)]
    mean = m[("farm_target_compile_seconds_sum", t)] / count if count else None

    SCREENSHOTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="farm-dashboard-chromium-")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                profile,
                executable_path=executable,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000},
            )
            try:
                page = browser.new_page()
                page.set_default_timeout(scaled(30) * 1000)
                r = page.goto(f"{farm.url}/ui/")
                assert r is not None and r.status == 401
                page.fill("input[name=token]", ADMIN_TOKEN)
                page.click("button[type=submit]")
                page.wait_for_url("**/ui/")
                page.click("header nav >> text=Workers")
                page.wait_for_url("**/ui/workers")
                row = page.locator(f"table.work tr[data-target='{target}']")
                assert row.count() == 1
                assert row.locator("td.workers").inner_text() == str(
                    int(m[("farm_target_workers", t)])
                )
                assert row.locator("td.failed").inner_text() == str(failed)
                assert row.locator("td.waiting").inner_text() == str(
                    int(m[("farm_target_queue_depth", t)])
                )
                if mean is not None:
                    assert row.locator("td.mean-compile").inner_text() == f"{mean:.1f} s"
                assert worker["id"] in page.locator("table.live-workers").inner_text()
                shot = tmp_path / "dashboard-workers.png"
                page.screenshot(path=str(shot), full_page=True)
                shutil.copy(shot, SCREENSHOTS / "dashboard-workers.png")
                # The failures link to the failed jobs, this one among them.
                row.locator("td.failed a").click()
                page.wait_for_url(re.compile(r".*/ui/jobs\?state=failed$"))
                assert bad[:12] in page.locator("main").inner_text()
            finally:
                browser.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    print(
        f"workers page: {target}: {failed} failed, mean compile "
        f"{'-' if mean is None else f'{mean:.1f} s'}; {SCREENSHOTS}/dashboard-workers.png"
    )
