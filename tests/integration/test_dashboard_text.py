"""What the dashboard's pages say, as HTML over HTTP (no browser): with auth
off there is no "Sign out"; a verification error is rounded; an id link is
never broken across lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry import models as m
from registry.api.dashboard_format import error_value
from tests.integration.test_api import CPU, _api, make_artifact

pytestmark = pytest.mark.integration


def test_auth_off_has_no_sign_out_and_errors_are_rounded(db_url: str, tmp_path: Path) -> None:
    for api in _api(db_url, tmp_path, farm_auth=False):
        digest = make_artifact(api.db, api.store, name="tiny", version="1", target=CPU)["digest"]
        with api.db.session() as s:
            # As a verifier reports it: every digit a float has.
            s.query(m.Artifact).filter_by(digest=digest).one().max_abs_err = 2.9802322387695312e-07
        page = api.client.get("/ui/")
        assert page.status_code == 200, page.text[:500]
        assert "Sign out" not in page.text and "auth is off" in page.text
        art = api.client.get(f"/ui/artifacts/{digest}").text
        assert "max abs err 2.98e-07" in art and "2.9802322387695312e-07" not in art
        version = api.client.get("/ui/models/tiny/versions/1").text
        assert "2.98e-07" in version and "2.9802322387695312e-07" not in version
        css = api.client.get("/ui/static/dashboard.css").text
        assert "a.mono { white-space: nowrap" in css


def test_with_auth_on_the_signed_in_user_can_sign_out(db_url: str, tmp_path: Path) -> None:
    for api in _api(db_url, tmp_path):
        page = api.client.get("/ui/", headers={"Authorization": f"Bearer {api.tokens['read']}"})
        assert page.status_code == 200
        assert "Sign out" in page.text and "test-read (read)" in page.text


def test_error_values_read_as_three_digits() -> None:
    assert error_value(None) == ""
    assert error_value(0.0) == "0"
    assert error_value(0.09375244140625) == "0.0938"
    assert error_value(2.9802322387695312e-07) == "2.98e-07"


def test_the_overview_counts_the_misses_its_page_lists(db_url: str, tmp_path: Path) -> None:
    """One notion of a miss: what nodes reported not getting. The overview's
    count covers the period its link opens, and the misses page, the
    coverage page and `farm coverage` count the same reports."""
    from datetime import datetime, timedelta, timezone
    from typing import Any, cast

    from registry.service import reports as report_service
    from tests.integration.test_api import CPU as cpu
    from tests.slowdown import scaled

    for api in _api(db_url, tmp_path, farm_auth=False):
        make_artifact(api.db, api.store, name="tiny", version="1", target=cpu)
        report = {
            "kind": "miss",
            "model": "tiny",
            "ref": "1",
            "version": "1",
            "inputs": ["int64[4,32]"],
            "grad_mode": "inference",
            "target": str(cpu),
        }
        # A shape the version covers, and a load (served): the first still counts.
        covered = {**report, "kind": "fallback", "inputs": ["int64[1,16]"], "code": "load"}
        served = {**report, "kind": "load", "inputs": ["int64[1,16]"]}
        r = api.client.post(
            "/v1/reports", json={"node": "node-a", "reports": [report, report, covered, served]}
        )
        assert r.status_code in (200, 202), r.text
        assert cast(Any, api.client.app).state.farm.reports.flush(scaled(30))
        # Two days old: outside the overview's period and the page's default.
        old = datetime.now(timezone.utc) - timedelta(days=2)
        report_service.store_reports(
            api.db, [{**report, "inputs": "int64[9,32]", "received_at": old, "reported_at": old}]
        )

        page = " ".join(api.client.get("/ui/").text.split())
        assert "resolves that found no artifact" not in page  # the API's own log is gone
        assert (
            '<b>3</b><span><a href="/ui/misses?since=24h">not served in the last day, '
            "as nodes reported"
        ) in page, page
        misses = " ".join(api.client.get("/ui/misses?since=24h").text.split())
        assert "<b>3</b> request(s) not served (last day)." in misses
        assert "int64[9,32]" not in misses
        every = " ".join(api.client.get("/ui/misses?since=").text.split())
        assert "<b>4</b> request(s) not served (all time)." in every

        cov = " ".join(api.client.get("/ui/models/tiny/coverage?since=24h").text.split())
        # int64[1,16] is covered, yet a node was not served it: the page says so.
        assert "Nodes reported <b>3</b> request(s) of this version not served" in cov
        assert 'href="/ui/misses?model=tiny&amp;since=24h"' in cov
        assert "every request nodes reported for this version is served" not in cov
