"""The repository's two distributions, as pip builds them from a clone: the
node's wheel (`pip install torch-farm`) holds farm/ and nothing of the
server's, and a process with only it and its base dependencies imports
farm.node but no registry, workers or migrations; the server's wheel
(`pip install torch-farm-server`) holds exactly those three, with their data
files, and needs the node's distribution at the same version. (A node loads
a farm-built artifact this way in tests/integration/test_pipeline.py.)"""

from __future__ import annotations

import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.fixtures.client_install import SERVER_SIDE, client_only_site, project_wheel
from tests.fixtures.farm import ROOT


def _wheel(path: Path) -> tuple[set[str], list[str], list[str]]:
    """Top-level names, every member, and the Requires-Dist lines."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return {n.split("/")[0] for n in names}, names, msg.get_all("Requires-Dist") or []


def _on_node(paths: list[str], code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a process that sees only the node's install (``paths``):
    -S, no site-packages of this environment; ``cwd`` is not the checkout
    (whose registry/ would be importable from it)."""
    script = f"import sys\nsys.path[:0] = {paths!r}\n{code}"
    return subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("wheels")
    return {d: project_wheel(where, d) for d in ("torch-farm", "torch-farm-server")}


def test_the_node_wheel_holds_the_farm_package_only(built: dict[str, Path]) -> None:
    tops, names, requires = _wheel(built["torch-farm"])
    assert tops == {"farm", "torch_farm-0.1.0.dist-info"}, tops
    assert "farm/node/__init__.py" in names and "farm/app/cli.py" in names
    # Its dependencies are the node's: none of the server's services.
    base = {r.split(";")[0].strip() for r in requires if "extra ==" not in r}
    assert not [
        r
        for r in base
        if r.split(">")[0].split("=")[0].split("[")[0]
        in ("celery", "sqlalchemy", "fastapi", "boto3", "uvicorn", "alembic", "redis")
    ]
    entry = (
        zipfile.ZipFile(built["torch-farm"])
        .read("torch_farm-0.1.0.dist-info/entry_points.txt")
        .decode()
    )
    assert "farm = farm.app.cli:main" in entry


def test_the_server_wheel_holds_registry_workers_and_migrations(built: dict[str, Path]) -> None:
    tops, names, requires = _wheel(built["torch-farm-server"])
    assert tops == {"registry", "workers", "migrations", "torch_farm_server-0.1.0.dist-info"}
    # The data files the API and `farm db upgrade` read.
    assert "registry/api/templates/dashboard/overview.html" in names
    assert "registry/api/templates/dashboard/dashboard.css" in names
    assert "migrations/alembic.ini" in names and "migrations/script.py.mako" in names
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert [n for n in versions if f"migrations/versions/{n}" not in names] == []
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"torch-farm=={version}" in requires, requires
    assert any(r.startswith("sqlalchemy") for r in requires)


def test_a_node_install_imports_the_node_and_nothing_of_the_server(tmp_path: Path) -> None:
    paths = client_only_site(tmp_path)
    code = f"""
import importlib.util
import farm.node, farm.app.cli
assert farm.__file__.startswith({paths[0]!r}), farm.__file__
present = [m for m in {SERVER_SIDE!r} if importlib.util.find_spec(m) is not None]
assert not present, present
print("ok")
"""
    out = _on_node(paths, code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr[-3000:]


def test_a_server_command_on_a_node_install_says_what_to_install(tmp_path: Path) -> None:
    paths = client_only_site(tmp_path)
    for argv in (["serve", "--embedded", "--port", "9"], ["db", "current"]):
        out = _on_node(paths, f"from farm.app import cli\nsys.exit(cli.main({argv!r}))", tmp_path)
        assert out.returncode == 1, out.stderr[-3000:]
        assert out.stderr.startswith(
            f"farm: error: farm {argv[0]} needs the farm's server packages"
        ), out.stderr[-3000:]
        assert "pip install torch-farm-server (from a clone: pip install ./server)" in out.stderr
