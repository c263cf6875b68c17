"""The compile child's report and files, as a hostile model would leave them:
each trick that would get the worker to upload and sign a file the build did
not write (the builder's key) is refused with a reason, and a real report is
taken as the worker's own copy of the bytes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from farm.build.child_output import ChildOutputError, take_artifacts, worker_dir

NAMES = {"aot_compile": "aot_compile.bin", "aoti": "aoti.pt2"}
KEY = b"-----BEGIN PRIVATE KEY-----\nsecret-builder-key\n-----END PRIVATE KEY-----\n"
ART = b"torch's bytes of a compiled program" * 100


@pytest.fixture
def build(tmp_path: Path) -> dict[str, Path]:
    """A build directory as a compile child leaves it, a builder key file of
    the worker's beside it, and the worker's own directory for taken bytes."""
    out = tmp_path / "build" / "out"
    out.mkdir(parents=True)
    key = tmp_path / "builder-key.pem"
    key.write_bytes(KEY)
    key.chmod(0o600)
    into = worker_dir(str(tmp_path))
    return {"out": out, "key": key, "into": into}


def report(path: Path | str, data: bytes, fmt: str = "aot_compile", **meta: Any) -> dict[str, Any]:
    """What compile_step returns for one artifact of these bytes."""
    m = {"format": fmt, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **meta}
    return {"artifacts": [{"path": str(path), "format": fmt, "meta": m}]}


def take(value: Any, b: dict[str, Path]) -> list[Any]:
    return take_artifacts(value, b["out"], b["into"], names=NAMES)


def nothing_taken(b: dict[str, Path]) -> bool:
    return not any(p.read_bytes() == KEY for p in b["into"].iterdir())


def test_a_real_report_is_taken_as_the_workers_own_copy(build: dict[str, Path]) -> None:
    (build["out"] / "aot_compile.bin").write_bytes(ART)
    (art,) = take(report(build["out"] / "aot_compile.bin", ART), build)
    assert art.path.parent == build["into"]
    assert art.path.read_bytes() == ART
    assert art.sha256 == hashlib.sha256(ART).hexdigest() and art.size == len(ART)
    assert art.format == "aot_compile"
    # The copy, not the child's file: a change there after taking it changes nothing.
    (build["out"] / "aot_compile.bin").write_bytes(KEY)
    assert art.path.read_bytes() == ART
    assert not os.access(art.path, os.W_OK) or os.geteuid() == 0
    assert oct(art.path.stat().st_mode & 0o777) == "0o444"


def test_result_rewritten_to_name_the_builder_key_is_refused(build: dict[str, Path]) -> None:
    (build["out"] / "aot_compile.bin").write_bytes(ART)
    # The attacker rewrites the path and, knowing the key, even its digest and size.
    with pytest.raises(ChildOutputError, match=r"not at .*where the build writes it"):
        take(report(build["key"], KEY), build)
    assert nothing_taken(build)


@pytest.mark.parametrize(
    "path",
    [
        "../../builder-key.pem",
        "{out}/../../builder-key.pem",
        "{out}/sub/../../../builder-key.pem",
        "/etc/passwd",
        "{out}/other.bin",
        "{out}/aoti.pt2",  # another format's file
        "",
    ],
)
def test_paths_outside_the_formats_file_are_refused(build: dict[str, Path], path: str) -> None:
    (build["out"] / "aot_compile.bin").write_bytes(ART)
    (build["out"] / "other.bin").write_bytes(ART)
    with pytest.raises(ChildOutputError):
        take(report(path.format(out=build["out"]), ART), build)
    assert not list(build["into"].iterdir())


def test_artifact_symlinked_to_the_builder_key_is_refused(build: dict[str, Path]) -> None:
    (build["out"] / "aot_compile.bin").symlink_to(build["key"])
    with pytest.raises(ChildOutputError, match="symlink"):
        take(report(build["out"] / "aot_compile.bin", KEY), build)
    assert nothing_taken(build)


def test_output_directory_symlinked_elsewhere_is_refused(
    build: dict[str, Path], tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "aot_compile.bin").write_bytes(KEY)
    build["out"].rmdir()
    build["out"].symlink_to(elsewhere)
    with pytest.raises(ChildOutputError, match="output directory"):
        take(report(build["out"] / "aot_compile.bin", KEY), build)
    assert nothing_taken(build)


def test_artifact_hardlinked_to_the_builder_key_is_refused(build: dict[str, Path]) -> None:
    os.link(build["key"], build["out"] / "aot_compile.bin")
    with pytest.raises(ChildOutputError, match="2 links"):
        take(report(build["out"] / "aot_compile.bin", KEY), build)
    assert nothing_taken(build)


def test_a_fifo_does_not_hang_the_worker_and_is_refused(build: dict[str, Path]) -> None:
    os.mkfifo(build["out"] / "aot_compile.bin")
    with pytest.raises(ChildOutputError, match="fifo"):
        take(report(build["out"] / "aot_compile.bin", b""), build)


def test_a_directory_is_refused(build: dict[str, Path]) -> None:
    (build["out"] / "aot_compile.bin").mkdir()
    with pytest.raises(ChildOutputError, match="directory"):
        take(report(build["out"] / "aot_compile.bin", b""), build)


def test_a_missing_artifact_is_refused(build: dict[str, Path]) -> None:
    with pytest.raises(ChildOutputError, match="cannot be taken"):
        take(report(build["out"] / "aot_compile.bin", ART), build)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "aot_compile.bin",
        json.loads('{"ok": true}'),
        {"artifacts": "x"},
        {"artifacts": []},
        {"artifacts": [["path", "format"]]},
        {"artifacts": [{"path": "x", "format": "pickle", "meta": {}}]},
        {"artifacts": [{"path": 7, "format": "aot_compile", "meta": {}}]},
        {"artifacts": [{"path": "x", "format": "aot_compile", "meta": []}]},
    ],
)
def test_malformed_reports_are_refused(build: dict[str, Path], value: Any) -> None:
    (build["out"] / "aot_compile.bin").write_bytes(ART)
    with pytest.raises(ChildOutputError):
        take(value, build)


def test_a_format_reported_twice_is_refused(build: dict[str, Path]) -> None:
    (build["out"] / "aot_compile.bin").write_bytes(ART)
    one = report(build["out"] / "aot_compile.bin", ART)
    with pytest.raises(ChildOutputError, match="twice"):
        take({"artifacts": one["artifacts"] * 2}, build)


def test_size_or_digest_that_disagree_with_what_the_worker_read_are_refused(
    build: dict[str, Path],
) -> None:
    path = build["out"] / "aot_compile.bin"
    path.write_bytes(ART)
    with pytest.raises(ChildOutputError, match="bytes where the worker read it"):
        take(report(path, ART, size=len(ART) + 1), build)
    with pytest.raises(ChildOutputError, match="sha256"):
        take(report(path, ART, sha256="0" * 64), build)
    with pytest.raises(ChildOutputError, match="says it is"):
        take(report(path, ART, format="aoti"), build)
    # Swapped after the child measured it (the report is of other bytes).
    said = report(path, ART)
    path.write_bytes(ART + b"!")
    with pytest.raises(ChildOutputError, match="changed after it was written"):
        take(said, build)


def test_a_package_that_is_not_a_zip_is_refused(build: dict[str, Path]) -> None:
    (build["out"] / "aoti.pt2").write_bytes(KEY)
    with pytest.raises(ChildOutputError, match="not a aoti file"):
        take(report(build["out"] / "aoti.pt2", KEY, fmt="aoti"), build)
