"""farm.core.codepack and farm.build.codeenv: reproducible packs, what goes in,
what a pack may contain, where an entrypoint's code is found (never imported),
and unpacking once per digest into a read-only directory."""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from farm.build.codeenv import CodeUnavailable, code_dir
from farm.core.codepack import (
    CodePackError,
    check_pack_bytes,
    collect_files,
    pack,
    plan_source,
    unpack,
)


def make_tree(root: Path) -> Path:
    pkg = root / "mypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def make():\n    return 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "layers.py").write_text("X = 1\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"junk")
    (pkg / "weights.bin").write_bytes(b"\0" * 100)
    (pkg / "notes.txt").write_text("keep me")
    (pkg / ".gitignore").write_text("*.bin\n")
    return pkg


def test_same_tree_same_digest_whatever_the_mtimes_owners_and_walk_order(
        tmp_path: Path) -> None:
    a = make_tree(tmp_path / "a")
    b = make_tree(tmp_path / "b")
    os.utime(b / "model.py", (1, 1))
    os.chmod(b / "notes.txt", 0o600)  # not executable either way: the same mode in the pack
    pa, pb = pack(a), pack(b)
    assert pa.digest == pb.digest and pa.data == pb.data
    assert pa.files == ("mypkg/.gitignore", "mypkg/__init__.py", "mypkg/model.py",
                        "mypkg/notes.txt",
                        "mypkg/sub/__init__.py", "mypkg/sub/layers.py")
    # A change of one byte is another pack.
    (b / "sub" / "layers.py").write_text("X = 2\n")
    assert pack(b).digest != pa.digest
    with tarfile.open(fileobj=io.BytesIO(pa.data)) as tar:
        for ti in tar:
            assert (ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname) == (0, 0, 0, "", "")


def test_gitignore_and_the_always_ignored_stay_out(tmp_path: Path) -> None:
    pkg = make_tree(tmp_path)
    (tmp_path / ".gitignore").write_text("mypkg/notes.txt\n")  # the parent's rules apply too
    names = [n for n, _ in collect_files(pkg)]
    assert "mypkg/weights.bin" not in names and "mypkg/notes.txt" not in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert "mypkg/.gitignore" in names


def test_a_directory_without_init_contributes_its_contents_as_import_roots(
        tmp_path: Path) -> None:
    (tmp_path / "mymodel.py").write_text("")
    (tmp_path / "helpers.py").write_text("")
    assert pack(tmp_path).files == ("helpers.py", "mymodel.py")
    assert pack(tmp_path / "mymodel.py").files == ("mymodel.py",)


def test_size_limit_names_the_largest_files(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("")
    (tmp_path / "checkpoint.pt").write_bytes(b"\1" * 5000)
    with pytest.raises(CodePackError, match=r"checkpoint\.pt.*Weights and data do not travel"):
        pack(tmp_path, max_bytes=4000)


def test_symlinks_are_refused(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("")
    (tmp_path / "secret").symlink_to("/etc/hostname")
    with pytest.raises(CodePackError, match="not a regular file"):
        pack(tmp_path)


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


@pytest.mark.parametrize("bad", ["../escape.py", "/abs.py", "a/../../b.py", "./x.py"])
def test_a_pack_with_a_path_outside_its_root_is_refused(bad: str) -> None:
    with pytest.raises(CodePackError, match="plain relative path"):
        check_pack_bytes(_tar([_file("ok.py"), _file(bad)]))


def test_links_devices_and_non_tars_are_refused() -> None:
    link = tarfile.TarInfo("evil.py")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/shadow"
    with pytest.raises(CodePackError, match="not a regular file"):
        check_pack_bytes(_tar([_file("ok.py"), (link, b"")]))
    with pytest.raises(CodePackError, match="not a code pack"):
        check_pack_bytes(b"PK\3\4 a zip, say")
    with pytest.raises(CodePackError, match="more than 10 bytes"):
        check_pack_bytes(_tar([_file("big.py", b"y" * 11)]), max_bytes=10)


def test_unpack_is_read_only(tmp_path: Path) -> None:
    p = pack(make_tree(tmp_path / "src"))
    blob = tmp_path / "p.tar"
    blob.write_bytes(p.data)
    dest = tmp_path / "out"
    assert unpack(blob, dest) == list(p.files)
    f = dest / "mypkg" / "model.py"
    assert f.read_text().startswith("def make")
    assert not os.access(f, os.W_OK) or os.geteuid() == 0  # root ignores modes
    assert oct(f.stat().st_mode & 0o777) == oct(0o444)
    assert oct((dest / "mypkg").stat().st_mode & 0o777) == oct(0o555)


def test_code_dir_unpacks_once_per_digest_and_checks_the_bytes(tmp_path: Path) -> None:
    p = pack(make_tree(tmp_path / "src"))
    blob = tmp_path / "blob"
    blob.write_bytes(p.data)
    fetches: list[str] = []
    lock = threading.Lock()

    def fetch(digest: str, dest: Path) -> None:
        with lock:
            fetches.append(digest)
        shutil.copy(blob, dest)

    root = tmp_path / "code"
    threads = [threading.Thread(target=code_dir, args=(p.digest,),
                                kwargs={"fetch": fetch, "root": root}) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = code_dir(p.digest, fetch=fetch, root=root)
    assert (d / "mypkg" / "sub" / "layers.py").read_text() == "X = 1\n"
    assert sorted(x.name for x in root.iterdir()) == [p.digest]  # no temp dirs left behind
    n = len(fetches)
    code_dir(p.digest, fetch=fetch, root=root)
    assert len(fetches) == n  # cached: no fetch at all

    def corrupt(digest: str, dest: Path) -> None:
        dest.write_bytes(p.data + b"tampered")

    with pytest.raises(CodeUnavailable, match="corrupt"):
        code_dir("0" * 64, fetch=corrupt, root=root)
    assert not (root / ("0" * 64)).exists()


def test_plan_source_finds_a_file_entrypoint_and_a_module_without_importing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodel.py").write_text("raise SystemExit('imported!')\n")
    plan = plan_source("./mymodel.py:make", cwd=tmp_path)
    assert (plan.entrypoint, plan.source) == ("mymodel:make", (tmp_path / "mymodel.py"))
    plan = plan_source("mymodel:make", cwd=tmp_path)
    assert plan.source == tmp_path / "mymodel.py"
    assert "mymodel" not in sys.modules
    pkg = make_tree(tmp_path / "proj")
    plan = plan_source(f"{pkg}/sub/layers.py:X", cwd=tmp_path)
    assert (plan.entrypoint, plan.source) == ("mypkg.sub.layers:X", pkg)
    plan = plan_source("mypkg.model:make", cwd=tmp_path / "proj")
    assert plan.source == pkg
    # Installed here (farm itself, torch): nothing to ship.
    assert plan_source("farm.zoo.basic:mlp", cwd=tmp_path).source is None
    assert plan_source("torch.nn:Linear", cwd=tmp_path).source is None
    # Not found here: nothing shipped, the farm's API decides.
    assert plan_source("nowhere_to_be_found:make", cwd=tmp_path).source is None
    with pytest.raises(CodePackError, match="bad entrypoint"):
        plan_source("not an entrypoint", cwd=tmp_path)
    with pytest.raises(CodePackError, match="no file"):
        plan_source("./missing.py:make", cwd=tmp_path)
