"""The warm node agent (farm.node.agent) and its client (farm.node.run), for
real: one agent process for the module, scripts run through ``python -m
farm.node.run``; args, env, cwd, stdin/stdout, exit codes and signals pass
through; two runs at once; another uid is refused; no agent: the client runs
the script itself; and a training artifact built here loads under the agent
with the same loss and gradients as in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from farm.node.agent import Refused, check_peer, request_status
from tests.slowdown import scaled

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
FELL_BACK = "running the command directly"


@pytest.fixture(scope="module")
def agent() -> Iterator[dict[str, Any]]:
    # A directory others may traverse (the other-uid test), the socket 0600.
    home = Path(tempfile.mkdtemp(prefix="farm-agent-test-"))
    os.chmod(home, 0o755)
    sock = home / "agent.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([PY, "-m", "farm.node.agent", "--socket", str(sock)], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "listening at ..." once the imports are done
    assert "listening at" in line, line
    ready = json.loads(line.split(": ", 2)[2])
    try:
        yield {"sock": sock, "home": home, "proc": proc, "ready": ready}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=scaled(30))
        shutil.rmtree(home, ignore_errors=True)


def script(dirpath: Path, body: str, name: str = "s.py") -> Path:
    path = dirpath / name
    path.write_text(textwrap.dedent(body))
    os.chmod(path, 0o644)
    return path


def farm_run(sock: Path, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", scaled(60))
    kw.setdefault("env", {**os.environ, "PYTHONPATH": str(ROOT)})
    return subprocess.run([PY, "-m", "farm.node.run", "--agent", str(sock), "--", *argv],
                          capture_output=True, text=True, **kw)


def test_the_agent_has_one_thread_and_no_cuda(agent: dict[str, Any]) -> None:
    st = request_status(agent["sock"])
    assert st["threads"] == 1 and st["cuda_initialized"] is False
    assert agent["ready"]["threads"] == 1 and agent["ready"]["cuda_initialized"] is False
    # A forked probe child found torch willing to start CUDA (no poisoned fork).
    assert agent["ready"]["fork_cuda_ok"] is True
    assert st["pid"] == agent["proc"].pid
    assert oct(agent["sock"].stat().st_mode & 0o777) == "0o600"


def test_args_env_cwd_stdin_stdout_and_exit_code(agent: dict[str, Any], tmp_path: Path) -> None:
    s = script(tmp_path, """
        import json, os, sys
        # torch is there already: the point of the agent.
        warm = "torch._dynamo" in sys.modules
        import torch
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X"),
                          "stdin": sys.stdin.read(), "ppid": os.getppid(), "warm": warm,
                          "cuda": torch.cuda.is_initialized(), "path0": sys.path[0],
                          "seed": torch.initial_seed(), "name": __name__}))
        print("to stderr", file=sys.stderr)
        sys.exit(int(os.environ["CODE"]))
    """)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "X": "é 1", "CODE": "3"}
    r = farm_run(agent["sock"], PY, str(s), "a", "b c", "--flag", input="in\nput",
                 cwd=work, env=env)
    assert r.returncode == 3, r.stderr
    assert FELL_BACK not in r.stderr and r.stderr.strip() == "to stderr"
    out = json.loads(r.stdout)
    assert out == {**out, "argv": [str(s), "a", "b c", "--flag"], "cwd": str(work),
                   "x": "é 1", "stdin": "in\nput", "ppid": agent["proc"].pid, "warm": True,
                   "cuda": False, "path0": str(tmp_path), "name": "__main__"}
    # A fresh process's seed, not the agent's nor the last child's.
    again = json.loads(farm_run(agent["sock"], PY, str(s), input="", cwd=work,
                                env={**env, "CODE": "0"}).stdout)
    assert again["seed"] != out["seed"]


def test_module_mode_and_an_uncaught_exception(agent: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "mod_here.py").write_text("import sys\nprint('mod', sys.argv[1:])\n")
    r = farm_run(agent["sock"], PY, "-m", "mod_here", "z", cwd=tmp_path)
    assert (r.returncode, r.stdout.strip()) == (0, "mod ['z']"), r.stderr
    # -c: argv[0] "-c", the working directory first on the path as "".
    r = farm_run(agent["sock"], PY, "-c", "import sys, mod_here; print(sys.argv, sys.path[0])",
                 "q", cwd=tmp_path)
    assert r.returncode == 0 and FELL_BACK not in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["mod ['q']", "['-c', 'q'] "], r.stdout
    r = farm_run(agent["sock"], PY, "-c", "raise ValueError('boom')")
    assert r.returncode == 1 and 'File "<string>", line 1' in r.stderr, r.stderr
    s = script(tmp_path, "raise ValueError('boom')\n")
    r = farm_run(agent["sock"], PY, str(s))
    assert r.returncode == 1 and "ValueError: boom" in r.stderr and FELL_BACK not in r.stderr
    assert "farm/node/agent.py" not in r.stderr  # the traceback starts at the script


def test_a_killing_signal_and_a_forwarded_one(agent: dict[str, Any], tmp_path: Path) -> None:
    s = script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert farm_run(agent["sock"], PY, str(s)).returncode == -signal.SIGTERM
    s = script(tmp_path, """
        import time
        try:
            # "ready" inside the try: a SIGINT that comes right after it (on a
            # loaded machine, before the try began) still prints "interrupted".
            print("ready", flush=True)
            time.sleep(600)
        finally:
            print("interrupted", flush=True)
    """, "sleeper.py")
    proc = subprocess.Popen([PY, "-m", "farm.node.run", "--agent", str(agent["sock"]), "--",
                             PY, str(s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=scaled(30))
    # KeyboardInterrupt in the child, which then ends by SIGINT as python does.
    assert proc.returncode == -signal.SIGINT, err
    assert out.strip() == "interrupted" and "KeyboardInterrupt" in err


def test_two_runs_at_once(agent: dict[str, Any], tmp_path: Path) -> None:
    s = script(tmp_path, """
        import os, sys, time
        me, other = sys.argv[1:]
        open(me, "w").close()
        deadline = time.time() + float(sys.argv[0] and os.environ["WAIT_S"])
        while not os.path.exists(other):  # each waits for the other: both run at once
            if time.time() > deadline:
                sys.exit(9)
            time.sleep(0.05)
        print(os.getpid())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WAIT_S": str(scaled(60))}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    procs = [subprocess.Popen([PY, "-m", "farm.node.run", "--agent", str(agent["sock"]), "--",
                               PY, str(s), *pair], stdout=subprocess.PIPE, text=True, env=env)
             for pair in ((a, b), (b, a))]
    outs = [p.communicate(timeout=scaled(90))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert len({int(o) for o in outs}) == 2


def test_no_agent_runs_the_script_itself(tmp_path: Path) -> None:
    s = script(tmp_path, "import os, sys\nprint('direct', sys.argv[1:])\nsys.exit(4)\n")
    r = farm_run(tmp_path / "none.sock", PY, str(s), "q")
    assert (r.returncode, r.stdout.strip()) == (4, "direct ['q']")
    assert r.stderr.count("\n") == 1 and FELL_BACK in r.stderr and "no agent at" in r.stderr


def test_a_command_the_agent_cannot_run_falls_back(agent: dict[str, Any], tmp_path: Path) -> None:
    s = script(tmp_path, "print('ran')\n")
    r = farm_run(agent["sock"], PY, "-X", "importtime", str(s))
    assert r.stdout.strip() == "ran" and "refused: python option -X" in r.stderr
    # torch read TORCH_LOGS at the agent's import: the child could not honour another.
    r = farm_run(agent["sock"], PY, str(s),
                 env={**os.environ, "PYTHONPATH": str(ROOT), "TORCH_LOGS": "+dynamo"})
    assert r.stdout.strip() == "ran" and "TORCH_LOGS differ" in r.stderr


def test_another_uid_is_refused(agent: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(Refused, match="not the agent's"):
        check_peer(os.getuid() + 1)
    check_peer(os.getuid())
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    system_py = shutil.which("python3", path="/usr/bin:/bin")
    if system_py is None:
        pytest.skip("no system python3 for the other uid (the venv's lives under /root)")
    # Past the socket's mode (opened for this test): the peer check still refuses.
    # The client is stdlib only: a copy runs under the system python as nobody.
    d = Path(tempfile.mkdtemp(prefix="farm-agent-nobody-"))
    os.chmod(d, 0o755)
    os.chmod(agent["sock"], 0o666)
    try:
        client = d / "run.py"
        shutil.copy(ROOT / "farm" / "node" / "run.py", client)
        os.chmod(client, 0o644)
        s = script(d, "import os\nprint('uid', os.getuid())\n")
        r = subprocess.run([system_py, str(client), "--agent", str(agent["sock"]), "--",
                            system_py, str(s)], capture_output=True, text=True, user=65534,
                           cwd=d, env={"PATH": "/usr/bin:/bin", "HOME": str(d)},
                           timeout=scaled(60))
        assert "refused: uid 65534 is not the agent's" in r.stderr
        assert r.stdout.strip() == "uid 65534", r.stderr  # then ran it itself
    finally:
        os.chmod(agent["sock"], 0o600)
        shutil.rmtree(d, ignore_errors=True)


TRAIN = """
    import json, sys
    import torch
    from farm.node.loader import load_artifact
    from farm.node.training import compiled_train_step
    from tests.models.training import make

    class LocalClient:  # FarmClient.load's shape, for the bytes the test built
        def load(self, resolved, *, module, class_of=None):
            return load_artifact(sys.argv[1], "aot_compile", module=module,
                                 trust_unverified=True)

    built = json.loads(open(sys.argv[2]).read())
    torch.manual_seed(0)
    step = compiled_train_step(LocalClient(), built, make())
    assert step.source == "farm", step.source
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
    loss = step(x, y)
    grads = {n: p.grad for n, p in step.program.named_parameters()}
    torch.save({"loss": loss.detach(), "grads": grads}, sys.argv[3])
"""


def test_a_training_artifact_under_the_agent_matches_a_fresh_process(
        agent: dict[str, Any], tmp_path: Path) -> None:
    from farm.build.compile import compile_artifacts
    from farm.core.specs import JobSpec
    from tests.unit.test_node_training import SPEC

    (art,) = compile_artifacts(JobSpec.from_json(SPEC), "cpu", tmp_path / "build",
                               aoti_unavailable="training")
    meta = {**art.meta, "model_class": "tests.models.training.Regressor+loss"}
    built = tmp_path / "built.json"
    built.write_text(json.dumps({"artifact": {"digest": "0" * 64, "format": art.format,
                                              "meta": meta}, "path": str(art.path)}))
    s = script(tmp_path, TRAIN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    r = farm_run(agent["sock"], PY, str(s), str(art.path), str(built),
                 str(tmp_path / "agent.pt"), cwd=ROOT)
    assert r.returncode == 0 and FELL_BACK not in r.stderr, r.stderr
    under_agent = time.time() - t0
    fresh = subprocess.run([PY, str(s), str(art.path), str(built), str(tmp_path / "fresh.pt")],
                           env=env, capture_output=True, text=True, cwd=ROOT, timeout=scaled(120))
    assert fresh.returncode == 0, fresh.stderr
    got, want = (torch.load(tmp_path / f"{n}.pt") for n in ("agent", "fresh"))
    assert sorted(got["grads"]) == sorted(want["grads"]) and got["grads"]
    assert torch.equal(got["loss"], want["loss"])
    for n, g in want["grads"].items():
        assert g is not None and torch.equal(got["grads"][n], g), n
    print(f"under the agent: {under_agent:.2f} s")


def test_the_client_imports_no_torch() -> None:
    r = subprocess.run([PY, "-c", "import sys, farm.node.run, farm.app.agent_commands; "
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                        "('torch', 'numpy', 'pydantic')))"],
                       capture_output=True, text=True, timeout=scaled(60), cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
