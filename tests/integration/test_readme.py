"""The README's quick start, run as written against a real farm.

Its blocks marked ``<!-- test -->`` (tests/readme.py) run in README order in
a fresh directory outside the checkout, in a shell whose environment is
activated as the README says (``source .venv/bin/activate``: the virtual
environment's ``bin`` first on PATH, ``VIRTUAL_ENV`` set) and whose
``FARM_URL`` points at the session farm, as the README's ``export`` line
does. A command, option, output or snippet that the code no longer takes
fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import readme
from tests.fixtures.farm import Farm
from tests.slowdown import scaled

pytestmark = pytest.mark.integration


def _activated(env: dict[str, str]) -> dict[str, str]:
    """What ``source .venv/bin/activate`` does to the environment."""
    venv_bin = Path(sys.executable).parent
    return {
        **env,
        "VIRTUAL_ENV": str(venv_bin.parent),
        "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', os.defpath)}",
    }


@pytest.fixture(scope="module")
def quick_start(farm: Farm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The README's marked blocks, run once; returns the shell's environment."""
    tmp = tmp_path_factory.mktemp("readme")
    work = tmp / "my-project"
    work.mkdir()
    env = _activated(
        {
            **farm.env,
            # A node of its own: a fresh cache, as on a new machine.
            "CLIENT_CACHE_DIR": str(tmp / "node-cache"),
            "HOME": str(tmp / "home"),
        }
    )
    # Not the checkout's code: the installed farm, from a directory of the user's.
    env.pop("PYTHONPATH", None)
    marked = readme.marked_blocks(readme.README.read_text())
    assert marked, "the README has no <!-- test --> blocks"
    for block in marked:
        readme.run_block(block, work, env, python=sys.executable, timeout=scaled(900))
    return {**env, "WORK": str(work)}


def test_the_readme_quick_start_runs_as_written(quick_start: dict[str, str]) -> None:
    work = Path(quick_start["WORK"])
    # What the blocks left behind is what the README says they make.
    assert (work / "mymodel.py").exists()
    assert (work / "node.py").exists()
    assert (work / "tinynet.pt2").exists()
    assert (work / "tinynet.pt2.attestation.json").exists()


def _farm(env: dict[str, str], cwd: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["farm", *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=scaled(300)
    )


def test_a_pinned_root_key_of_a_reset_farm_says_where_it_is_and_how_to_retrust(
    quick_start: dict[str, str], farm: Farm, tmp_path: Path
) -> None:
    """The node pinned a root key for this URL on first use, and the farm at
    the URL now has another one (as after a new FARM_HOME on the same port):
    the refusal names the pin and the command; that command fixes it."""
    from farm.core.keys import generate_keypair
    from farm.node.trust import pin_path

    cache = tmp_path / "node-cache"
    env = {k: v for k, v in quick_start.items() if k != "FARM_ROOT_KEY"}
    env["CLIENT_CACHE_DIR"] = str(cache)
    pin = pin_path(cache, farm.url)
    pin.parent.mkdir(parents=True)
    _, old_public = generate_keypair()  # the farm that was on this URL before
    pin.write_text(old_public)
    fetch = ("fetch", "tinynet@prod", "--input", "float32[4,12]", "-o", str(tmp_path / "t.pt2"))

    r = _farm(env, str(tmp_path), *fetch)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused (trust_list)" in r.stderr
    assert str(pin) in r.stderr
    assert f"farm trust reset {farm.url}" in r.stderr

    r = _farm(env, str(tmp_path), "trust", "show", farm.url)
    assert r.returncode == 0 and str(pin) in r.stdout, r.stdout + r.stderr
    r = _farm(env, str(tmp_path), "trust", "reset", farm.url)
    assert r.returncode == 0, r.stderr
    assert "forgot root key" in r.stdout and not pin.exists()

    r = _farm(env, str(tmp_path), *fetch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert pin.exists()  # the farm's current key, pinned on first use again
    r = _farm(env, str(tmp_path), "trust", "reset", farm.url)
    assert r.returncode == 0 and "forgot root key" in r.stdout


def test_submit_target_auto_builds_for_this_machine(
    quick_start: dict[str, str], tmp_path: Path
) -> None:
    """`farm submit --target auto` takes what resolve and fetch take: this
    machine's own target, detected, sent as a full target."""
    import json

    from farm.node.local_target import node_target

    work = quick_start["WORK"]
    r = _farm(
        quick_start,
        work,
        "submit",
        "./mymodel.py:make",
        "--name",
        "tinynet",
        "--version",
        "2",
        "--input",
        "float32[4,12]",
        "--backend",
        "eager",
        "--target",
        "auto",
        "--wait",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    view = json.loads(r.stdout)
    assert view["state"] == "succeeded", view
    assert [b["target"] for b in view["builds"]] == [str(node_target(None))]
    r = _farm(
        quick_start,
        work,
        "submit",
        "./mymodel.py:make",
        "--name",
        "tinynet",
        "--version",
        "3",
        "--input",
        "float32[4,12]",
        "--target",
        "auto:gpu",
    )
    assert r.returncode == 2 and "auto:cuda" in r.stderr, r.stderr


def test_artifacts_lists_short_digests_that_delete_takes(
    quick_start: dict[str, str], tmp_path: Path
) -> None:
    """`farm artifacts` prints 12-character digests; `farm delete artifact`
    takes any unique prefix of 4 or more, and says what is wrong otherwise."""
    import json

    work = quick_start["WORK"]
    r = _farm(quick_start, work, "artifacts", "tinynet@prod")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() and all("tinynet@1" in line for line in r.stdout.splitlines()), (
        r.stdout
    )
    r = _farm(
        quick_start,
        work,
        "submit",
        "./mymodel.py:make",
        "--name",
        "tinynet",
        "--version",
        "4",
        "--input",
        "float32[4,12]",
        "--backend",
        "aot_eager",
        "--wait",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = _farm(quick_start, work, "artifacts", "tinynet@4", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows and {row["version"] for row in rows} == {"4"}
    digest = rows[0]["digest"]

    r = _farm(quick_start, work, "delete", "artifact", digest[:2])
    assert r.returncode == 2 and "too short" in r.stderr, r.stderr
    r = _farm(quick_start, work, "delete", "artifact", "zz" + digest[:6])
    assert r.returncode == 2 and "bad digest" in r.stderr, r.stderr
    r = _farm(quick_start, work, "delete", "artifact", digest[:8])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"deleted artifact {digest[:12]}" in r.stdout
    r = _farm(quick_start, work, "artifacts", "tinynet")
    assert digest[:12] not in r.stdout
    r = _farm(quick_start, work, "delete", "artifact", digest[:8])
    assert r.returncode == 1 and "no artifact's digest starts with" in r.stderr, r.stderr


PLAIN_LOAD = """
import sys, torch
sys.path.insert(0, ".")
from mymodel import make
torch.manual_seed(0)
model = make().eval()
x = torch.randn(4, 12)
with open(sys.argv[1], "rb") as f:
    fn = torch.compiler.load_compiled_function(f)
with torch.no_grad():
    print(float((fn(model, x) - model(x)).abs().max()))
"""


def test_fetch_plain_writes_torchs_own_file(quick_start: dict[str, str], tmp_path: Path) -> None:
    """The farm's aot_compile file is a bundle (kernels beside torch's bytes)
    that torch's loader cannot read; --plain writes torch's own bytes, and
    says which loader opens what was written."""
    work = quick_start["WORK"]
    farm_file, plain_file = tmp_path / "farm.pt", tmp_path / "plain.pt"
    args = ("fetch", "tinynet@prod", "--input", "float32[4,12]", "--format", "aot_compile")
    r = _farm(quick_start, work, *args, "-o", str(farm_file))
    assert r.returncode == 0, r.stderr
    assert "farm.node.loader" in r.stderr and "the farm's file" in r.stdout
    r = _farm(quick_start, work, *args, "-o", str(plain_file), "--plain")
    assert r.returncode == 0, r.stderr
    assert "torch.compiler.load_compiled_function" in r.stderr
    assert "torch's own aot_compile file" in r.stdout
    assert not Path(str(plain_file) + ".attestation.json").exists()
    load = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(plain_file)],
        cwd=work,
        env=quick_start,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert load.returncode == 0, load.stderr[-3000:]
    assert float(load.stdout.strip().splitlines()[-1]) < 1e-4


def test_verify_without_a_root_key_says_where_to_get_one(
    quick_start: dict[str, str], farm: Farm, tmp_path: Path
) -> None:
    env = {k: v for k, v in quick_start.items() if k != "FARM_ROOT_KEY"}
    env["CLIENT_CACHE_DIR"] = str(tmp_path / "fresh-node")
    r = _farm(env, quick_start["WORK"], "verify", "tinynet.pt2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FARM_ROOT_KEY" in r.stderr and farm.url in r.stderr
    assert str(tmp_path / "fresh-node" / "trusted-keys") in r.stderr


BROKEN = """\
import torch
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        raise ValueError("the tensor is not what this model takes")


def make():
    return Broken()
"""


def test_a_failed_build_on_a_terminal_says_its_reason_once_with_the_users_path(
    quick_start: dict[str, str], tmp_path: Path
) -> None:
    """In a terminal (stdout and stderr on one screen) a failed `farm submit
    --wait` prints its reason once, and names ./broken.py, never the
    sandbox's copy of it."""
    import pty
    import time

    (tmp_path / "broken.py").write_text(BROKEN)
    primary, secondary = pty.openpty()
    argv = [
        "farm",
        "submit",
        "./broken.py:make",
        "--name",
        "broken",
        "--version",
        "1",
        "--input",
        "float32[4,12]",
        "--wait",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env={**quick_start, "TERM": "dumb"},
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    chunks: list[bytes] = []
    deadline = time.monotonic() + scaled(600)
    while time.monotonic() < deadline:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert proc.wait(timeout=scaled(60)) == 1
    out = b"".join(chunks).decode(errors="replace")
    # The trace names the line of the raise, in the user's file (line 11).
    assert out.count("graph break at ./broken.py:11") == 1, out[-4000:]
    assert "its error is above" in out
    assert "farm-slot" not in out and "/code/" not in out, out[-4000:]
