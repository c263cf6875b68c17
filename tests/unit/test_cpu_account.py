"""The suite's CPU account (tests/cpu_account.py): its report sums each
module's tests and ranks modules by CPU."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cpu_account import report


def test_the_report_sums_tests_by_module_and_ranks_by_cpu(tmp_path: Path) -> None:
    lines = [{"worker": "gw0", "test": "tests/a.py::t1", "cpu_s": 2.0, "wall_s": 3.0},
             {"worker": "gw0", "test": "tests/a.py::t2[x]", "cpu_s": 1.5, "wall_s": 1.0},
             {"worker": "gw1", "test": "tests/b.py::t", "cpu_s": 9.0, "wall_s": 4.0}]
    f = tmp_path / "cpu.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = report(str(f)).splitlines()
    assert out[0] == "12 CPU-s in 3 tests"
    assert out[2].split() == ["9.0", "4.0", "1", "tests/b.py"]
    assert out[3].split() == ["3.5", "4.0", "2", "tests/a.py"]
