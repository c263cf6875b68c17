"""The read model's pure parts: buckets never hide a loadable artifact, refs
resolve as the database path resolves them, answers are JSON of a bounded size."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from farm.core.specs import GradMode
from registry import resolver
from registry.api.resolve_answer import hit_body
from registry.service.read_model_load import (
    ModelView,
    VersionView,
    bucket_of,
    request_buckets,
)
from tests.unit.test_resolver import ALL_TARGETS, INPUTS, art

T = datetime(2026, 12, 5, tzinfo=timezone.utc)


def test_a_node_checks_the_bucket_of_every_artifact_the_resolver_would_give_it() -> None:
    # Every artifact target against every node target (the resolver's own
    # cross product, edge cases included) and both grad modes.
    pairs = accepted = 0
    for i, built in enumerate(ALL_TARGETS):
        for mode in GradMode:
            a = art(i, built, grad_mode=mode)
            for node in ALL_TARGETS:
                for asked in GradMode:
                    pairs += 1
                    result = resolver.resolve([a], target=node, inputs=INPUTS, grad_mode=asked)
                    seen = bucket_of(a.grad_mode, a.target) in request_buckets(asked, node)
                    if result.best is not None:
                        accepted += 1
                        assert seen, (built, node, asked)
    assert accepted > 100 and pairs > 40_000


def _view() -> ModelView:
    view = ModelView(1, "m", "default")
    for n, version in enumerate(("1", "2", "3")):
        view.versions[version] = VersionView(n, version, T + timedelta(hours=n))
    return view


def test_refs_resolve_as_the_database_path_does() -> None:
    view = _view()
    assert view.version_for(None).version == "3"  # no latest alias: the newest
    view.aliases["latest"] = "1"
    assert view.version_for(None).version == "1"
    view.aliases["prod"] = "2"
    assert view.version_for("prod").version == "2"
    assert view.version_for("3").version == "3"
    assert view.version_for("nope") is None
    # Equal creation times: the higher id is the newer (as ORDER BY created_at, id).
    same = ModelView(2, "n", "default")
    same.versions["a"] = VersionView(7, "a", T)
    same.versions["b"] = VersionView(5, "b", T)
    assert same.version_for(None).version == "a"


def test_an_answer_is_json_naming_the_build_statement_by_digest() -> None:
    view = _view()
    version = view.versions["1"]
    record = art(1, meta={"model_class": "m.Net"})
    version.add(record, "ab" * 32)
    version.version_statement = json.dumps({"payload": "v"})
    view.alias_statements["prod"] = json.dumps({"payload": "a"})
    view.aliases["prod"] = "1"
    result = resolver.resolve(
        version.records, target=record.target, inputs=INPUTS, grad_mode=GradMode.INFERENCE
    )
    body = hit_body(
        view=view, version=version, ref="prod", result=result, why=["w"], base_url="http://farm/"
    )
    answer = json.loads(body)
    art_out = answer["artifact"]
    assert art_out["attestation"] == {
        "build_statement": {"digest": "ab" * 32, "url": f"/v1/attestations/{'ab' * 32}"},
        "version": {"payload": "v"},
        "alias": {"payload": "a"},
    }
    assert art_out["download_url"] == f"http://farm/v1/artifacts/{record.digest}/blob"
    assert art_out["meta"] == {"model_class": "m.Net"} and art_out["version"] == "1"
    assert (answer["model"], answer["version"], answer["ref"]) == ("m", "1", "prod")
    # Asked by its version, the alias statement stays out.
    by_version = json.loads(
        hit_body(
            view=view, version=version, ref="1", result=result, why=[], base_url="http://farm/"
        )
    )
    assert by_version["artifact"]["attestation"]["alias"] is None
