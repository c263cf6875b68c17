"""`farm submit` and the code it ships: the entrypoint as a file, --source, and
nothing for installed code; the client packs and uploads only what the farm lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from farm.app import cli, commands
from farm.core.codepack import pack


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def submit(self, spec: Any, *, source: Any = None) -> dict[str, Any]:
        self.calls.append((spec, source))
        return {"id": "j1", "state": "queued", "code": None}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()
    monkeypatch.setattr(commands, "farm_client", lambda args: client)
    return client


def submit(*argv: str) -> int:
    return cli.main(["submit", *argv, "--name", "m", "--version", "1", "--input",
                     "float32[2,4]"])


def test_a_file_entrypoint_ships_that_file(fake: FakeClient, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodel.py").write_text("raise SystemExit('never imported')\n\n\n"
                                         "def make(): ...\n")
    monkeypatch.chdir(tmp_path)
    assert submit("./mymodel.py:make") == 0
    (spec, source), = fake.calls
    assert spec.model.entrypoint == "mymodel:make"
    assert source == tmp_path / "mymodel.py"


def test_source_and_installed_code(fake: FakeClient, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "proj" / "nets"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def make(): ...\n")
    monkeypatch.chdir(tmp_path)
    assert submit("nets:make", "--source", "proj") == 0
    assert fake.calls[-1][1] == tmp_path / "proj"
    assert submit("farm.zoo.basic:mlp") == 0
    assert fake.calls[-1][1] is False  # installed: nothing shipped


def test_the_client_uploads_a_pack_only_when_the_farm_lacks_it(tmp_path: Path) -> None:
    from farm.node.client import FarmClient

    (tmp_path / "mymodel.py").write_text("def make():\n    pass\n")
    have: dict[str, bytes] = {}
    jobs: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/v1/code/"):
            digest = path.rsplit("/", 1)[1]
            if request.method == "HEAD":
                return httpx.Response(200 if digest in have else 404)
            have[digest] = request.content
            return httpx.Response(201, json={"digest": digest})
        if path == "/v1/jobs":
            import json

            jobs.append(json.loads(request.content))
            return httpx.Response(201, json={"id": "j", "state": "queued"})
        return httpx.Response(404, json={"detail": "no"})

    from farm.core.inputs import parse_inputs
    from farm.core.specs import JobSpec, ModelRef

    c = FarmClient(url="http://127.0.0.1:9", token="t", transport=httpx.MockTransport(handler))
    spec = JobSpec(name="m", version="1", model=ModelRef("mymodel:make"),
                   inputs=parse_inputs(["float32[2,4]"]))
    first = c.submit(spec, source=tmp_path / "mymodel.py")
    second = c.submit(spec, source=tmp_path / "mymodel.py")
    digest = pack(tmp_path / "mymodel.py").digest
    assert first["code"]["uploaded"] is True and second["code"]["uploaded"] is False
    assert list(have) == [digest]
    assert [j["code_digest"] for j in jobs] == [digest, digest]
    c.submit(spec, source=False)  # ship nothing: the job names no code pack
    assert "code_digest" not in jobs[-1]
