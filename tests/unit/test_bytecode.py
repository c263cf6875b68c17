"""farm.build.bytecode: compiled bytecode for build children where this
machine's Python keeps none (an image with PYTHONDONTWRITEBYTECODE=1 and no
.pyc files), read-only to the children."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from farm.build import bytecode
from farm.build.isolation import Isolation
from farm.build.sandbox import isolation_unavailable, run_isolated

ROOT = Path(__file__).resolve().parents[2]


def _ask(env: dict[str, str]) -> bool:
    r = subprocess.run(
        [sys.executable, "-c", "from farm.build import bytecode; print(bytecode.keeps_none())"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items()
                if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "True"


def test_a_python_whose_packages_carry_their_bytecode_needs_none(tmp_path: Path) -> None:
    # This project's .venv is byte-compiled (scripts/bootstrap.sh): its .pyc
    # files are read whether or not the process may write any.
    assert not _ask({})
    assert not _ask({"PYTHONDONTWRITEBYTECODE": "1"})


def test_torch_without_its_bytecode_asks_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch installed without .pyc files (as on the lent GPU image): its
    # compile_fx has none beside it.
    torch_dir = tmp_path / "site" / "torch"
    (torch_dir / "_inductor").mkdir(parents=True)
    (torch_dir / "__init__.py").write_text("")
    (torch_dir / "_inductor" / "compile_fx.py").write_text("")

    class Spec:
        origin = str(torch_dir / "__init__.py")

    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(bytecode.importlib.util, "find_spec", lambda name: Spec())
    assert bytecode.keeps_none()
    # An operator's own prefix is theirs to fill.
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "theirs"))
    assert not bytecode.keeps_none()
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    # Its bytecode beside it: nothing to do.
    import py_compile

    py_compile.compile(str(torch_dir / "_inductor" / "compile_fx.py"), doraise=True)
    assert not bytecode.keeps_none()


def test_a_filled_directory_is_what_a_process_that_writes_none_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "bcprobe"
    pkg.mkdir(parents=True)
    src = pkg / "__init__.py"
    # The prefix gets the bytecode of "X = 2"; the source then says "X = 1",
    # with the same size and mtime, which is all a .pyc records of it: a
    # process that imports X == 2 ran the prefix's bytecode, not the source.
    src.write_text("X = 2\n")
    prefix = tmp_path / "pycache"
    out = bytecode.fill(prefix, [tmp_path / "src"])
    assert "error" not in out, out
    stat = src.stat()
    src.write_text("X = 1\n")
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path / "src")}
    run = [sys.executable, "-c", "import bcprobe; print(bcprobe.X)"]
    with_prefix = subprocess.run(run, capture_output=True, text=True, timeout=60,
                                 env={**env, "PYTHONPYCACHEPREFIX": str(prefix)})
    assert with_prefix.stdout.strip() == "2", with_prefix.stderr
    without = subprocess.run(run, capture_output=True, text=True, timeout=60,
                             env={**env, "PYTHONPYCACHEPREFIX": str(tmp_path / "empty")})
    assert without.stdout.strip() == "1", without.stderr
    # Nothing was written beside the source.
    assert not (pkg / "__pycache__").exists()


def test_children_get_the_directory_only_where_it_is_wanted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bytecode.SETTING, str(tmp_path / "pyc"))
    monkeypatch.setattr(bytecode, "keeps_none", lambda: True)
    assert bytecode.child_env() == {"PYTHONPYCACHEPREFIX": str(tmp_path / "pyc")}
    monkeypatch.setenv(bytecode.SETTING, "off")
    assert bytecode.child_env() == {}
    monkeypatch.setenv(bytecode.SETTING, str(tmp_path / "pyc"))
    monkeypatch.setattr(bytecode, "keeps_none", lambda: False)
    assert bytecode.child_env() == {}
    assert bytecode.fill_in_background() is None


def test_roots_are_the_stdlib_torchs_site_directory_and_the_farms_package() -> None:
    import sysconfig

    import torch

    dirs = bytecode.roots()

    def covered(p: Path) -> bool:
        return any(d == p or d in p.parents for d in dirs)

    assert covered(Path(torch.__file__).resolve().parent)
    # With a prefix set, Python reads the standard library's bytecode there too.
    assert covered(Path(sysconfig.get_paths()["stdlib"]).resolve())
    # A source checkout: its package, not the checkout (its .venv, tests...).
    assert covered(ROOT / "farm") and ROOT not in dirs
    # Nothing twice: compileall recurses into a root's subdirectories.
    assert not any(a in b.parents for a in dirs for b in dirs)


PROBE = '''
import os, sys

def plant(p):
    prefix = os.environ.get("PYTHONPYCACHEPREFIX", "")
    target = os.path.join(prefix, "planted.pyc")
    try:
        with open(target, "w") as f:
            f.write("planted")
        wrote = True
    except OSError as exc:
        wrote = str(exc)
    return {"prefix": prefix, "wrote": wrote, "sees": os.listdir(prefix)}
'''


@pytest.mark.skipif(isolation_unavailable() is not None,
                    reason="no bubblewrap sandbox on this machine")
def test_a_sandboxed_child_reads_the_directory_and_cannot_plant_bytecode_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = tmp_path / "pyc"
    prefix.mkdir()
    (prefix / "kept").write_text("the worker's")
    code = tmp_path / "code"
    code.mkdir()
    (code / "bcplant.py").write_text(PROBE)
    for d in (tmp_path, code):
        d.chmod(0o755)
    # Writable by anyone here: only the sandbox's read-only bind stops the child.
    prefix.chmod(0o777)
    monkeypatch.setenv(bytecode.SETTING, str(prefix))
    monkeypatch.setattr(bytecode, "keeps_none", lambda: True)
    res = run_isolated("bcplant:plant", {}, timeout_s=120, memory_mb=3000,
                       import_paths=[code], isolation=Isolation(), warm=False)
    assert res.ok, (res.error, res.stderr_tail)
    v = res.value
    assert v["prefix"] == str(prefix) and "kept" in v["sees"], v
    assert v["wrote"] is not True, v  # read-only in the sandbox
    assert sorted(p.name for p in prefix.iterdir()) == ["kept"]
