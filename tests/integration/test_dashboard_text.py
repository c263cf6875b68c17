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


def test_the_overview_labels_its_two_kinds_of_miss(db_url: str, tmp_path: Path) -> None:
    """The API's own resolve misses and what nodes reported not getting are
    two counts, each saying which; the node reports' one links to the page
    that lists them, with the same count."""
    from typing import Any, cast

    from tests.integration.test_api import CPU as cpu
    from tests.slowdown import scaled

    for api in _api(db_url, tmp_path, farm_auth=False):
        make_artifact(api.db, api.store, name="tiny", version="1", target=cpu)
        report = {
            "kind": "miss",
            "model": "tiny",
            "inputs": ["int64[4,32]"],
            "grad_mode": "inference",
            "target": str(cpu),
        }
        r = api.client.post("/v1/reports", json={"node": "node-a", "reports": [report, report]})
        assert r.status_code in (200, 202), r.text
        assert cast(Any, api.client.app).state.farm.reports.flush(scaled(30))
        page = " ".join(api.client.get("/ui/").text.split())
        assert "resolves that found no artifact (the API's answers)" in page
        assert '<b>2</b><span><a href="/ui/misses">not served, as nodes reported' in page, page
        misses = api.client.get("/ui/misses").text
        assert "<td><b>2</b></td>" in misses
