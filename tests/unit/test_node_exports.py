"""``from farm.node import compiled`` is the function the README calls,
whatever was imported before it (a submodule of the same name shadowed it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("before", ["", "import farm.node.compiled", "import farm.node.client"])
def test_compiled_is_callable_as_the_readme_calls_it(before: str, tmp_path: Path) -> None:
    code = (f"{before}\nimport torch\nfrom farm.node import compiled\n"
            "fast = compiled(torch.nn.Linear(2, 2), model='m', ref='prod',"
            " example_inputs=['float32[1,2]'])\n"
            "print(fast.source, '|', fast.reason)")
    env = {**os.environ, "FARM_URL": _dead_url(), "CLIENT_CACHE_DIR": str(tmp_path / "c"),
           "FARM_NODE_TARGET_CACHE": "off"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    source, _, reason = r.stdout.strip().partition(" | ")
    # Nothing answers: JIT, with the reason, and no crash.
    assert source == "jit" and "cannot reach the farm" in reason, r.stdout
