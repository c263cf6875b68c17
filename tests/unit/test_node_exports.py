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


def test_the_node_client_imports_no_retry_library() -> None:
    """tenacity's import was 0.1 s of every node's start; the client retries
    with a loop of its own (tests/unit/test_client_retries.py)."""
    code = "import sys, farm.node.compiled\nprint('tenacity' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False"], r.stdout


@pytest.mark.parametrize("grad_mode", ["training", "inference"])
def test_a_training_handle_starts_its_imports_before_the_farm_answers(
    grad_mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training artifact is always an aot_compile one, so the imports its
    load needs start at once; an inference one waits for the answer's format
    (an AOTI package needs none of them)."""
    from farm.node.client import FarmClient
    from farm.node.compiled import prefetch_compiled
    from farm.node.errors import FarmUnavailable

    monkeypatch.setenv("CLIENT_CACHE_DIR", str(tmp_path / "c"))
    client = FarmClient(_dead_url(), retries=0)
    handle = prefetch_compiled(model="m", ref="1", example_inputs=["float32[1,2]"],
                               grad_mode=grad_mode, device="cpu", client=client)
    with pytest.raises(FarmUnavailable):
        handle.result(timeout=120)
    started = handle._import_thread is not None
    if started:
        assert handle._import_thread is not None
        handle._import_thread.join(timeout=300)
    assert started == (grad_mode == "training")
