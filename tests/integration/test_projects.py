"""Projects and roles, attacked as a hostile team would: through `farm` (the
CLI in this process) and plain HTTP against the real API under uvicorn, on
PostgreSQL and SQLite.

The farm holds ``payments`` in the ``default`` project (versions 1 and 2,
``prod`` -> 1), maintained by ``dev``. ``mallory`` maintains another
project, ``rival``; ``rita`` is only a reader of ``default``; ``fleet`` is a
plain read token, as fleet nodes hold.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from registry import service
from registry.service import trust
from tests.integration.test_api import CPU
from tests.integration.test_everyday import Served, make_artifact, served  # noqa: F401

pytestmark = pytest.mark.integration

SUBMIT = ("submit", "farm.zoo.stack:stack", "--input", "float32[2,16]", "--target", str(CPU))


@dataclass
class Teams:
    served: Served
    tokens: dict[str, str]

    def farm(self, who: str, *argv: str) -> tuple[int, str, str]:
        return self.served.farm(*argv, token=self.tokens[who])

    def http(self, who: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.served.url, headers={"Authorization": f"Bearer {self.tokens[who]}"}
        )

    def prod(self) -> str | None:
        aliases = service.list_aliases(self.served.db, "payments", history=False)["aliases"]
        return next((a["version"] for a in aliases if a["alias"] == "prod"), None)


def _token(farm: Served, *argv: str) -> str:
    out = farm.ok("token", "create", *argv, "--json")
    return str(json.loads(out)["token"])


@pytest.fixture
def teams(served: Served) -> Iterator[Teams]:  # noqa: F811 - the fixture imported above
    make_artifact(served, name="payments", version="1")
    make_artifact(served, name="payments", version="2", fingerprint="e" * 64)
    service.record_heartbeat(
        served.db, worker_id="w:1", kind="compile", queue=CPU.queue, target=str(CPU)
    )
    served.ok("project", "create", "rival")
    tokens = {
        "admin": "everyday-admin-token",
        # A submit token made the usual way: a maintainer of default.
        "dev": _token(served, "dev", "--role", "submit"),
        "mallory": _token(served, "mallory", "--project", "rival=maintainer"),
        "rita": _token(served, "rita", "--role", "submit", "--project", "default=reader"),
        "fleet": _token(served, "fleet", "--role", "read"),
    }
    t = Teams(served, tokens)
    code, out, err = t.farm("dev", "alias", "set", "payments", "prod", "1")
    assert code == 0, (out, err)
    yield t


def test_another_projects_maintainer_cannot_move_an_alias(teams: Teams) -> None:
    code, out, err = teams.farm("mallory", "alias", "set", "payments", "prod", "2")
    assert code != 0, out
    assert "403" in err or "project 'default'" in err, err
    assert "project 'default'" in err and "'maintainer'" in err, err
    assert teams.prod() == "1"
    # Nor delete it, nor a version, over plain HTTP.
    with teams.http("mallory") as c:
        r = c.delete("/v1/models/payments/aliases/prod")
        assert r.status_code == 403 and "project 'default'" in r.json()["detail"], r.text
        r = c.delete("/v1/models/payments/versions/2")
        assert r.status_code == 403, r.text
        # Nor turn on build on miss (any fleet token's reports would then start builds).
        r = c.put("/v1/models/payments/policy", json={"build_on_miss": True})
        assert r.status_code == 403, r.text
    assert teams.prod() == "1"
    assert {v["version"] for v in service.list_models(teams.served.db)[0]["versions"]} == {"1", "2"}


def test_a_reader_cannot_add_a_version(teams: Teams) -> None:
    before = len(service.list_jobs(teams.served.db))
    code, out, err = teams.farm("rita", *SUBMIT, "--name", "payments", "--version", "3")
    assert code != 0, out
    assert "has role 'reader' in project 'default'" in err, err
    assert "'maintainer'" in err, err
    assert len(service.list_jobs(teams.served.db)) == before
    assert teams.served.enqueued == []


def test_the_issues_takeover_is_refused(teams: Teams) -> None:
    """`farm submit evil.py:make --name payments --version prod`: from another
    project it is a 403, from the model's own project a 409 (a version may
    not be named like an alias); either way prod still points at 1."""
    for argv in (
        ("--name", "payments", "--version", "prod"),
        ("--name", "payments", "--version", "prod", "--project", "rival"),
    ):
        code, out, err = teams.farm("mallory", *SUBMIT, *argv)
        assert code != 0, out
        assert "project 'default'" in err and "'maintainer'" in err, err
    code, out, err = teams.farm("dev", *SUBMIT, "--name", "payments", "--version", "prod")
    assert code != 0, out
    assert "version 'prod' is also an alias of 'payments'" in err, err
    assert teams.prod() == "1"
    assert teams.served.enqueued == []
    versions = {v["version"] for v in service.list_models(teams.served.db)[0]["versions"]}
    assert "prod" not in versions


def test_version_named_like_an_alias_and_the_reverse_are_409(teams: Teams) -> None:
    make_artifact(teams.served, name="payments", version="rc1", fingerprint="d" * 64)
    spec = {
        "name": "payments",
        "version": "prod",
        "model": {"entrypoint": "farm.zoo.stack:stack"},
        "inputs": ["float32[2,16]"],
        "targets": [str(CPU)],
    }
    with teams.http("dev") as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 409, r.text
        assert "also an alias" in r.json()["detail"]
        r = c.put("/v1/models/payments/aliases/rc1", json={"version": "1"})
        assert r.status_code == 409, r.text
        assert "alias 'rc1' is also a version of 'payments'" in r.json()["detail"]
    code, _, err = teams.farm("dev", "alias", "set", "payments", "rc1", "2")
    assert code != 0 and "also a version" in err, err


def test_a_model_of_another_project_cannot_be_claimed(teams: Teams) -> None:
    """mallory's own project takes new models; a name of another project's is refused."""
    code, out, err = teams.farm(
        "mallory", *SUBMIT, "--name", "ledger", "--version", "1", "--project", "rival"
    )
    assert code == 0, (out, err)
    assert service.list_models(teams.served.db)[0]["name"] == "ledger"
    projects = {m["name"]: m["project"] for m in service.list_models(teams.served.db)}
    assert projects == {"ledger": "rival", "payments": "default"}
    # dev (default's maintainer) cannot add to ledger, with or without --project.
    code, _, err = teams.farm("dev", *SUBMIT, "--name", "ledger", "--version", "2")
    assert code != 0 and "project 'rival'" in err, err


def test_reads_follow_projects_and_fleet_tokens_read_everything(teams: Teams) -> None:
    with teams.http("mallory") as c:
        r = c.get("/v1/models/payments")
        assert r.status_code == 403 and "project 'default'" in r.json()["detail"], r.text
        r = c.get(
            "/v1/resolve",
            params={"model": "payments", "ref": "prod", "input": "int64[1,16]", "target": str(CPU)},
        )
        assert r.status_code == 403, r.text
        assert [m["name"] for m in c.get("/v1/models").json()["models"]] == []
    for who in ("fleet", "rita"):
        with teams.http(who) as c:
            assert c.get("/v1/models/payments").status_code == 200
            r = c.get(
                "/v1/resolve",
                params={
                    "model": "payments",
                    "ref": "prod",
                    "input": "int64[1,16]",
                    "target": str(CPU),
                },
            )
            assert r.status_code == 200, r.text


def test_the_dashboard_shows_a_confined_token_only_its_projects(teams: Teams) -> None:
    with teams.http("mallory") as c:
        assert "payments" not in c.get("/ui/models").text
        r = c.get("/ui/models/payments")
        assert r.status_code == 403 and "project &#39;default&#39;" in r.text, r.text[-2000:]
        assert c.get("/ui/models/payments/versions/1").status_code == 403
    with teams.http("fleet") as c:
        assert "payments" in c.get("/ui/models").text
        r = c.get("/ui/models/payments")
        assert r.status_code == 200 and "<th>project</th>" in r.text


def test_history_and_signed_statement_say_who_moved_an_alias(teams: Teams) -> None:
    code, out, err = teams.farm("dev", "alias", "set", "payments", "prod", "2")
    assert code == 0, (out, err)
    code, out, err = teams.farm("fleet", "alias", "list", "payments")
    assert code == 0, err
    assert "prod: 1 -> 2  by dev (project default)" in out, out
    # The version binding too: who submitted a version, in `farm models` and
    # in the version statement the API signed.
    code, out, err = teams.farm(
        "mallory", *SUBMIT, "--name", "ledger", "--version", "1", "--project", "rival"
    )
    assert code == 0, (out, err)
    code, out, err = teams.farm("admin", "models")
    assert "ledger  [project rival]" in out and "artifact(s)  by mallory" in out, out
    stored = trust.get_binding(teams.served.db, "ledger", trust.VERSION, "1")
    assert stored is not None
    version = json.loads(base64.b64decode(json.loads(stored[1])["payload"]))["predicate"]
    assert (version["submitted_by"], version["project"]) == ("mallory", "rival")
    stored = trust.get_binding(teams.served.db, "payments", trust.ALIAS, "prod")
    assert stored is not None
    payload = json.loads(base64.b64decode(json.loads(stored[1])["payload"]))
    assert payload["predicate"]["set_by"] == "dev"
    assert payload["predicate"]["project"] == "default"
    assert payload["predicate"]["version"] == "2"


def test_only_admins_create_projects_and_only_owners_grant(teams: Teams) -> None:
    code, _, err = teams.farm("mallory", "project", "create", "mine")
    assert code != 0 and "needs role 'admin'" in err, err
    code, _, err = teams.farm("mallory", "project", "grant", "default", "mallory", "maintainer")
    assert code != 0 and "'owner'" in err, err
    code, out, err = teams.farm("admin", "project", "grant", "rival", "mallory", "owner")
    assert code == 0, err
    # Now an owner of rival: may grant there, still not in default.
    code, out, err = teams.farm("mallory", "project", "grant", "rival", "dev", "reader")
    assert code == 0 and "dev is reader of rival" in out, (out, err)
    code, out, err = teams.farm("fleet", "project", "list")
    assert code == 0 and "rival" in out and "owner       mallory" in out, out
    code, out, err = teams.farm("mallory", "project", "revoke", "rival", "dev")
    assert code == 0 and "no longer reader of rival" in out, (out, err)
