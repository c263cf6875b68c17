"""A build worker's scratch directories go when it exits: its zygote slot
(/tmp/farm-slot-PID) and its compiler-free PATH (farm-nocc-bin-*); a forked
child that exits first leaves its parent's in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, os, sys
from farm.build import child_env, zygote

slot = zygote.slot_root()
nocc = child_env.without_compilers()["PATH"]
(slot / "build-file").write_text("x")
pid = os.fork()
if pid == 0:
    sys.exit(0)          # a fork's normal exit runs the atexit handlers it inherited
os.waitpid(pid, 0)
print(json.dumps({"slot": str(slot), "nocc": nocc,
                  "after_child": [os.path.isdir(str(slot)), os.path.isdir(nocc)]}))
"""


def test_slot_and_nocc_dirs_go_at_exit_and_survive_a_forks_exit(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "FARM_BUILD_ZYGOTE": "on"},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["after_child"] == [True, True]
    assert Path(out["slot"]).parent == tmp_path and Path(out["nocc"]).parent == tmp_path
    assert not Path(out["slot"]).exists() and not Path(out["nocc"]).exists()
    assert list(tmp_path.iterdir()) == []
