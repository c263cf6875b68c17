"""`farm submit`'s line about the code it shipped counts the files and their
own bytes, not the tar's padding ("1 files, 10.0 KB" for a 94-byte file)."""

from __future__ import annotations

from pathlib import Path

from farm.app.commands import code_line
from farm.core.codepack import pack
from farm.node.client import _file_bytes


def test_one_small_file_reads_as_one_file_of_its_own_size(tmp_path: Path) -> None:
    f = tmp_path / "tinycnn.py"
    f.write_text("x = 1\n" * 83)  # 498 bytes
    p = pack(f)
    assert p.size >= 10 * 1024  # the tar: headers and padding
    assert _file_bytes(p.data) == 498
    line = code_line(
        {
            "source": "./tinycnn.py",
            "files": len(p.files),
            "size": p.size,
            "source_bytes": _file_bytes(p.data),
            "digest": p.digest,
            "uploaded": True,
        }
    )
    assert line.startswith("code: ./tinycnn.py (1 file, 498 B; pack 10.0 KB, sha256 ")
    assert line.endswith(", uploaded)")


def test_several_files_and_an_older_answer_without_source_bytes() -> None:
    line = code_line(
        {"source": "pkg", "files": 3, "size": 20480, "digest": "ab" * 32, "uploaded": False}
    )
    assert "(3 files; pack 20.0 KB, sha256 abababababab, already on the farm)" in line
