"""Wheels and pinned requirements in a code pack (farm.core.wheels, the pack's
.farm-env entries, farm.build.codeenv.env_dir): what is refused and why, that
the digest covers them, and the worker's real pip install into a read-only
per-digest directory, offline (wheels built here, --find-links to them)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from farm.build.codeenv import CodeUnavailable, env_dir
from farm.core.codepack import CodePackError, pack, unpack
from farm.core.wheels import (
    REQUIREMENTS_FILE,
    WHEELS_DIR,
    WheelError,
    canonical_requirements,
    check_wheel,
    parse_pinned,
    wheel_top_levels,
)
from tests.fixtures.wheels import build_wheel

SHA = "a" * 64


def fake_wheel(where: Path, filename: str, members: list[str]) -> Path:
    """A zip with a wheel's name and the given members (enough for the checks,
    which read names only; pip is not asked to install it)."""
    path = where / filename
    dist = "-".join(filename.split("-")[:2])
    with zipfile.ZipFile(path, "w") as z:
        for m in [*members, f"{dist}.dist-info/METADATA"]:
            z.writestr(m, "")
    return path


# --- pins ------------------------------------------------------------------------------


def test_pins_parse_with_comments_continuations_and_hashes() -> None:
    text = (f"# tools\nSix==1.16.0 \\\n    --hash=sha256:{SHA}  # why not\n\n"
            f"attrs == 23.2.0 --hash=sha256:{SHA.upper()}\n")
    pins = parse_pinned(text)
    assert [(p.name, p.version, p.hashes) for p in pins] == [
        ("attrs", "23.2.0", (f"sha256:{SHA}",)), ("six", "1.16.0", (f"sha256:{SHA}",))]
    assert canonical_requirements(pins) == (f"attrs==23.2.0 --hash=sha256:{SHA}\n"
                                            f"six==1.16.0 --hash=sha256:{SHA}\n")


@pytest.mark.parametrize(("text", "says"), [
    ("six==1.16.0\nattrs\n", "line 2: 'attrs' is not pinned"),
    ("six>=1.16\n", "line 1: 'six>=1.16' is not pinned"),
    ("six==1.*\n", "is not pinned"),
    ("-r other.txt\n", "line 1: '-r other.txt' is not pinned"),
    ("https://example.com/x.whl\n", "is not pinned"),
    ("six==1.16.0 --index-url https://x\n", "only --hash=sha256:<hex> may follow"),
    ("six==1.16.0; python_version<'3'\n", "is not pinned"),
    (f"six==1.16.0 --hash=sha256:{SHA}\nattrs==23.2.0\n", "attrs do not"),
    ("six==1.16.0\nSix==1.15.0\n", "six is pinned twice"),
    ("# nothing\n\n", "pins nothing"),
    ("Torch==2.13.0\n", "torch is the farm's own"),
    ("torch_farm==0.1\n", "torch-farm is the farm's own"),
])
def test_unpinned_or_odd_lines_are_refused_naming_the_line(text: str, says: str) -> None:
    with pytest.raises(WheelError) as exc:
        parse_pinned(text, source="req.txt")
    assert says in str(exc.value), str(exc.value)


# --- wheels ----------------------------------------------------------------------------


def test_top_levels_of_a_wheel() -> None:
    assert wheel_top_levels(["mynets/__init__.py", "helper.py", "ext.cpython-311-x86_64.so",
                             "mynets-1.0.dist-info/RECORD",
                             "mynets-1.0.data/purelib/extra/__init__.py",
                             "mynets-1.0.data/scripts/run"]) == {"mynets", "helper", "ext",
                                                                 "extra"}


@pytest.mark.parametrize(("filename", "members", "says"), [
    ("torch-2.13.0-cp311-cp311-linux_x86_64.whl", ["torch/__init__.py"], "torch is the farm's"),
    ("Triton-3.0.0-py3-none-any.whl", ["triton/__init__.py"], "triton is the farm's"),
    ("torch_farm-0.1-py3-none-any.whl", ["farm/__init__.py"], "torch-farm is the farm's"),
    ("innocent-1.0-py3-none-any.whl", ["innocent.py", "torch/__init__.py"],
     "installs torch, which would shadow"),
    ("sneaky-1.0-py3-none-any.whl", ["sneaky-1.0.data/purelib/farm/__init__.py"],
     "installs farm"),
    ("notawheel.zip", ["x.py"], "not a wheel file name"),
])
def test_wheels_that_would_shadow_the_worker_are_refused(tmp_path: Path, filename: str,
                                                         members: list[str], says: str) -> None:
    w = fake_wheel(tmp_path, filename, members)
    with pytest.raises(WheelError) as exc:
        check_wheel(w)
    assert says in str(exc.value), str(exc.value)
    # The pack refuses it too, so `farm submit` stops before any upload.
    with pytest.raises(CodePackError, match=says.split(",")[0]):
        pack(None, wheels=[w])


def test_wheels_and_pins_travel_in_the_pack_and_its_digest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "mymodel.py").write_text("X = 1\n")
    w = fake_wheel(tmp_path, "mynets-1.0-py3-none-any.whl", ["mynets/__init__.py"])
    plain = pack(src)
    with_wheel = pack(src, wheels=[w])
    assert with_wheel.digest != plain.digest
    assert with_wheel.files == (f"{WHEELS_DIR}/{w.name}", "mymodel.py")
    only = pack(None, wheels=[w])
    assert only.files == (f"{WHEELS_DIR}/{w.name}",)
    # Pins: the pack holds them canonically, so two spellings are one digest.
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("six==1.16.0\nattrs==23.2.0\n")
    b.write_text("# same pins\nATTRS == 23.2.0\n\nsix==1.16.0  # comment\n")
    pa, pb = pack(None, requirements=a), pack(None, requirements=b)
    assert pa.digest == pb.digest == hashlib.sha256(pa.data).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(pa.data)) as tar:
        member = tar.extractfile(REQUIREMENTS_FILE)
        assert member is not None
        assert member.read() == b"attrs==23.2.0\nsix==1.16.0\n"
    (src / ".farm-env").mkdir()
    (src / ".farm-env" / "x").write_text("")
    with pytest.raises(CodePackError, match="a name the farm keeps"):
        pack(src)


# --- the worker's install ----------------------------------------------------------------


def unpacked(tmp_path: Path, **kw: object) -> tuple[str, Path]:
    p = pack(None, **kw)  # type: ignore[arg-type]
    blob = tmp_path / f"{p.digest}.tar"
    blob.write_bytes(p.data)
    code = tmp_path / "code" / p.digest
    code.parent.mkdir(exist_ok=True)
    unpack(blob, code)
    return p.digest, code


def test_worker_installs_wheels_and_pins_once_per_digest_read_only(tmp_path: Path) -> None:
    mine = build_wheel(tmp_path / "mine", "mynets", "1.0",
                       {"mynets/__init__.py": "import helperlib\nVALUE = helperlib.TWO * 21\n"})
    # A pinned dependency, found offline through --find-links.
    links = tmp_path / "links"
    links.mkdir()
    dep = build_wheel(tmp_path / "dep", "helperlib", "2.0", {"helperlib.py": "TWO = 2\n"})
    dep.rename(links / dep.name)
    req = tmp_path / "requirements.txt"
    digest_hex = hashlib.sha256((links / dep.name).read_bytes()).hexdigest()
    req.write_text(f"helperlib==2.0 --hash=sha256:{digest_hex}\n")
    digest, code = unpacked(tmp_path, wheels=[mine], requirements=req)
    root = tmp_path / "env"
    site = env_dir(digest, code, root=root, find_links=str(links))
    assert site == root / digest
    assert (site / "mynets" / "__init__.py").is_file() and (site / "helperlib.py").is_file()
    assert not (site / "mynets" / "__init__.py").stat().st_mode & 0o222  # read-only
    out = subprocess.run([sys.executable, "-c", "import mynets; print(mynets.VALUE)"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "42", out.stderr
    # Once per digest: the second call installs nothing (pip is not even found).
    assert env_dir(digest, code, root=root, find_links="/nonexistent") == site
    assert [p.name for p in root.iterdir()] == [digest]  # no install leftovers
    # A wrong hash is pip's refusal, reported with its words.
    req.write_text(f"helperlib==2.0 --hash=sha256:{'0' * 64}\n")
    (tmp_path / "bad").mkdir()
    bad, bad_code = unpacked(tmp_path / "bad", requirements=req)
    with pytest.raises(CodeUnavailable, match=r"(?i)hash"):
        env_dir(bad, bad_code, root=root, find_links=str(links))
    assert not (root / bad).exists()


def test_worker_refuses_a_pack_that_would_shadow_torch(tmp_path: Path) -> None:
    # A pack made by hand (not by `farm submit`, which refuses it first).
    w = fake_wheel(tmp_path, "innocent-1.0-py3-none-any.whl", ["torch/__init__.py"])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = w.read_bytes()
        ti = tarfile.TarInfo(f"{WHEELS_DIR}/{w.name}")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    blob = tmp_path / "pack.tar"
    blob.write_bytes(buf.getvalue())
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    code = tmp_path / "code"
    unpack(blob, code)
    with pytest.raises(CodeUnavailable, match="installs torch, which would shadow"):
        env_dir(digest, code, root=tmp_path / "env")


def test_a_pack_without_wheels_has_no_environment(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("X = 1\n")
    p = pack(src)
    blob = tmp_path / "p.tar"
    blob.write_bytes(p.data)
    unpack(blob, tmp_path / "code")
    assert env_dir(p.digest, tmp_path / "code", root=tmp_path / "env") is None


# --- farm submit --wheel / --requirements ------------------------------------------------


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[object, dict[str, object]]] = []

    def submit(self, spec: object, **kw: object) -> dict[str, object]:
        self.calls.append((spec, kw))
        return {"id": "j1", "state": "queued", "code": None}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> RecordingClient:
    from farm.app import commands

    client = RecordingClient()
    monkeypatch.setattr(commands, "farm_client", lambda args: client)
    monkeypatch.chdir(tmp_path)
    return client


def cli_submit(*argv: str) -> int:
    from farm.app import cli

    return cli.main(["submit", *argv, "--name", "m", "--version", "1", "--input",
                     "float32[2,4]"])


def test_submit_ships_the_wheel_not_a_same_named_tree_beside_it(
        recorded: RecordingClient, tmp_path: Path) -> None:
    # A checkout of the wheel's own project in the current directory: the wheel
    # is what was asked for, so the tree does not go too.
    (tmp_path / "mynets").mkdir()
    # (The tree has no factory: submit's typo check must look at the wheel's
    # code, not at it. The second submit ships the tree, which then needs one.)
    (tmp_path / "mynets" / "__init__.py").write_text("")
    w = fake_wheel(tmp_path, "mynets-1.0-py3-none-any.whl", ["mynets/__init__.py"])
    req = tmp_path / "req.txt"
    req.write_text("six==1.16.0\n")
    assert cli_submit("mynets:make", "--wheel", str(w), "--requirements", str(req)) == 0
    ((spec, kw),) = recorded.calls
    assert spec.model.entrypoint == "mynets:make"  # type: ignore[attr-defined]
    assert kw == {"source": False, "wheels": [str(w)], "requirements": str(req)}
    # Another module's wheel (a dependency): the model's own tree still goes.
    (tmp_path / "mynets" / "__init__.py").write_text("def make():\n    pass\n")
    dep = fake_wheel(tmp_path, "helperlib-2.0-py3-none-any.whl", ["helperlib.py"])
    assert cli_submit("mynets:make", "--wheel", str(dep)) == 0
    assert recorded.calls[-1][1] == {"source": tmp_path / "mynets", "wheels": [str(dep)]}


def test_submit_refuses_unpinned_lines_and_torch_wheels_before_the_farm(
        recorded: RecordingClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    req = tmp_path / "req.txt"
    req.write_text("six==1.16.0\nnumpy>=1.26\n")
    assert cli_submit("farm.zoo.basic:mlp", "--requirements", str(req)) == 2
    err = capsys.readouterr().err
    assert "line 2: 'numpy>=1.26' is not pinned" in err, err
    w = fake_wheel(tmp_path, "torch-2.13.0-py3-none-any.whl", ["torch/__init__.py"])
    assert cli_submit("farm.zoo.basic:mlp", "--wheel", str(w)) == 2
    assert "torch is the farm's own" in capsys.readouterr().err
    assert recorded.calls == []


def test_an_upload_with_an_unpinned_line_is_refused_naming_it() -> None:
    from farm.core.codepack import check_pack_bytes

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        body = b"six==1.16.0\nnumpy\n"
        ti = tarfile.TarInfo(REQUIREMENTS_FILE)
        ti.size = len(body)
        tar.addfile(ti, io.BytesIO(body))
    with pytest.raises(CodePackError, match="line 2: 'numpy' is not pinned"):
        check_pack_bytes(buf.getvalue())


def test_a_failed_import_of_a_job_with_wheels_says_dependencies_are_not_installed() -> None:
    from farm.build.codeenv import NO_DEPS_HINT
    from farm.build.sandbox import SandboxResult
    from workers.tasks import _with_hint

    def res(kind: str, error: str) -> SandboxResult:
        return SandboxResult(ok=False, wall_s=1.0, peak_rss_mb=1.0, error_type=kind,
                             error=error)

    missing = res("farm.core.modelref.ModelImportError",
                  "cannot import module 'm': ModuleNotFoundError: No module named 'dep'")
    assert _with_hint("head", missing, ["/code", "/env"]) == f"head ({NO_DEPS_HINT})"
    assert _with_hint("head", res("builtins.ModuleNotFoundError", "No module named 'dep'"),
                      ["/code", "/env"]).endswith(f"({NO_DEPS_HINT})")
    # No wheels or pins in the pack, or another failure: the error as it was.
    assert _with_hint("head", missing, ["/code"]) == "head"
    assert _with_hint("head", res("builtins.AttributeError", "no attribute 'mkae'"),
                      ["/code", "/env"]) == "head"


def test_the_client_ships_a_wheel_that_provides_the_module_and_no_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import httpx

    from farm.core.inputs import parse_inputs
    from farm.core.specs import JobSpec, ModelRef
    from farm.node.client import FarmClient

    have: dict[str, bytes] = {}
    jobs: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/code/"):
            digest = request.url.path.rsplit("/", 1)[1]
            if request.method == "HEAD":
                return httpx.Response(200 if digest in have else 404)
            have[digest] = request.content
            return httpx.Response(201, json={"digest": digest})
        jobs.append(json.loads(request.content))
        return httpx.Response(201, json={"id": "j", "state": "queued"})

    (tmp_path / "mynets").mkdir()  # a checkout beside the wheel: not shipped
    (tmp_path / "mynets" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    w = fake_wheel(tmp_path, "mynets-1.0-py3-none-any.whl", ["mynets/__init__.py"])
    c = FarmClient(url="http://127.0.0.1:9", token="t", transport=httpx.MockTransport(handler))
    spec = JobSpec(name="m", version="1", model=ModelRef("mynets:make"),
                   inputs=parse_inputs(["float32[2,4]"]))
    out = c.submit(spec, wheels=[w])
    assert out["code"]["digest"] == pack(None, wheels=[w]).digest == jobs[-1]["code_digest"]
    with tarfile.open(fileobj=io.BytesIO(have[out["code"]["digest"]])) as tar:
        assert tar.getnames() == [".farm-env", WHEELS_DIR, f"{WHEELS_DIR}/{w.name}"]
    # Without the wheel the tree is the code, as before.
    assert c.submit(spec)["code"]["digest"] == pack(tmp_path / "mynets").digest


def test_a_worker_installs_pins_from_farm_pip_find_links(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own path from job to sandbox paths (workers.tasks._code_paths),
    with the farm setting, not the network: the pack's pin is found in the
    FARM_PIP_FIND_LINKS directory and installed once for the pack's digest."""
    from farm.core.inputs import parse_inputs
    from farm.core.settings import Settings
    from farm.core.specs import JobSpec, ModelRef
    from workers import context, tasks

    links = tmp_path / "links"
    links.mkdir()
    dep = build_wheel(tmp_path / "dep", "helperlib", "2.0", {"helperlib.py": "TWO = 2\n"})
    dep.rename(links / dep.name)
    req = tmp_path / "requirements.txt"
    req.write_text("helperlib==2.0\n")
    (tmp_path / "mymodel.py").write_text("import helperlib\n")
    p = pack(tmp_path / "mymodel.py", requirements=req)

    class Store:
        def get_to_file(self, digest: str, dest: Path) -> None:
            assert digest == p.digest
            Path(dest).write_bytes(p.data)

    monkeypatch.setenv("FARM_PIP_FIND_LINKS", str(links))
    settings = Settings(farm_home=tmp_path / "home")
    assert settings.farm_pip_find_links == str(links)
    monkeypatch.setattr(context, "settings", lambda: settings)
    monkeypatch.setattr(context, "blob_store", lambda: Store())
    spec = JobSpec(name="m", version="1", model=ModelRef("mymodel:make"),
                   inputs=parse_inputs(["float32[2,4]"]), code_digest=p.digest)
    code, site = tasks._code_paths(spec)
    assert code == str(tmp_path / "home" / "code" / p.digest)
    assert site == str(tmp_path / "home" / "code-env" / p.digest)
    assert (Path(site) / "helperlib.py").read_text() == "TWO = 2\n"
    assert tasks._code_paths(spec) == [code, site]  # once per digest
