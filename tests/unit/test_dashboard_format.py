"""The dashboard's display helpers: envelopes decoded (or their error shown),
nested JSON flattened, and the sign-in's way back kept on the dashboard."""

from __future__ import annotations

import json

from farm.core import attest
from farm.core.keys import generate_keypair
from registry.api import dashboard_format as fmt
from registry.api.dashboard import _local_next


def _envelope() -> tuple[dict[str, object], str]:
    private_pem, _ = generate_keypair()
    digest = "ab" * 32
    stmt = attest.statement(f"sha256:{digest}.aoti", digest, attest.BUILD_PREDICATE,
                            {"builder": {"id": "host:1", "keyid": "k1"},
                             "artifact": {"digest": digest, "size": 3}})
    return attest.sign_statement(private_pem, stmt), digest


def test_a_signed_statement_is_decoded_field_by_field() -> None:
    envelope, digest = _envelope()
    for given in (envelope, json.dumps(envelope)):
        out = fmt.decode_envelope(given)
        assert out["error"] is None
        assert out["payload_type"] == attest.IN_TOTO_PAYLOAD_TYPE
        assert out["predicate_type"] == attest.BUILD_PREDICATE
        assert out["subject"] == {"name": f"sha256:{digest}.aoti", "sha256": digest}
        assert len(out["keyids"]) == 1 and len(out["keyids"][0]) == 64
        assert ("builder.id", "host:1") in fmt.flatten(out["predicate"])


def test_a_malformed_or_missing_envelope_renders_its_error() -> None:
    assert fmt.decode_envelope(None)["error"] == "none stored"
    assert "not JSON" in fmt.decode_envelope("{nope")["error"]
    bad = {"payloadType": "x", "payload": "!!!", "signatures": [{"keyid": "", "sig": "AA=="}]}
    assert "base64" in fmt.decode_envelope(bad)["error"]


def test_flatten_names_every_leaf() -> None:
    rows = fmt.flatten({"a": {"b": 1, "c": [1, 2]}, "d": [{"e": None}], "f": {}, "g": True})
    assert rows == [("a.b", "1"), ("a.c", "1, 2"), ("d[0].e", "—"), ("f", "{}"), ("g", "yes")]


def test_small_formatters() -> None:
    assert fmt.duration("2026-12-01T10:00:00", "2026-12-01T10:00:12.5") == "12.5 s"
    assert fmt.duration(None, "2026-12-01T10:00:00") == ""
    assert fmt.human_bytes(512) == "512 B" and fmt.human_bytes(170336) == "166.3 KB"
    assert fmt.short_time("2026-12-01T17:22:41.123+00:00") == "2026-12-01 17:22:41"


def test_the_way_back_after_sign_in_stays_on_the_dashboard() -> None:
    assert _local_next("/ui/jobs/abc?x=1") == "/ui/jobs/abc?x=1"
    for hostile in ("//evil.example/ui/", "https://evil.example/ui/", "/v1/tokens", "/ui\\..",
                    "/ui/\r\nSet-Cookie: x=1", None, ""):
        assert _local_next(hostile) == "/ui/", hostile
