"""The CLI's argument parsing and its one-line errors (no farm needed)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from farm.app import admin_commands, cli, commands
from farm.core.inputs import TensorSpec

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("llama", ("llama", None)),
        ("llama@1.0", ("llama", "1.0")),
        ("llama@prod", ("llama", "prod")),
        ("my-model_2.x@v1+cu130", ("my-model_2.x", "v1+cu130")),
    ],
)
def test_model_ref(text: str, expected: tuple[str, str | None]) -> None:
    assert cli.parse_model_ref(text) == expected


@pytest.mark.parametrize("text", ["", "@prod", "llama@", "lla ma", "llama@a@b", "../x", "x@-1"])
def test_bad_model_ref(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_model_ref(text)


def test_resolve_args() -> None:
    a = parse("resolve", "llama@prod", "--input", "bfloat16[8,512]", "-i", "int64[8,512]",
              "--train")
    assert a.model == ("llama", "prod")
    assert a.inputs == [TensorSpec.parse("bfloat16[8,512]"), TensorSpec.parse("int64[8,512]")]
    assert a.train and a.target == "auto" and not a.json


def test_submit_args() -> None:
    a = parse("submit", "farm.zoo.llama:make", "--name", "llama", "--version", "1",
              "--input", "float32[2..64,128]", "--kwargs", '{"layers": 2}',
              "--target", "cpu", "--target", "cuda/gpu=NVIDIA%20H200",
              "--mode", "max-autotune", "--wait", "--json")
    assert a.entrypoint == "farm.zoo.llama:make"
    assert a.kwargs == {"layers": 2}
    assert a.targets == ["cpu", "cuda/gpu=NVIDIA%20H200"]
    assert a.mode == "max-autotune" and a.wait and a.json
    assert str(a.inputs[0]) == "float32[2..64,128]"
    assert not a.regional


def test_submit_takes_named_inputs_and_regional() -> None:
    a = parse("submit", "./hf.py:make", "--name", "llama", "--version", "1",
              "-i", "input_ids=int64[1,16]{0..31999}", "-i", "batch.x=float32[4,8]",
              "--regional")
    assert [s.name for s in a.inputs] == ["input_ids", "batch.x"] and a.regional
    r = parse("resolve", "llama", "-i", "attention_mask=int64[1,16]{0..1}")
    assert str(r.inputs[0]) == "attention_mask=int64[1,16]{0..1}"


def test_other_commands_parse() -> None:
    assert parse("status", "abc", "--json").job_id == "abc"
    assert parse("alias", "set", "llama", "prod", "1.0").func is admin_commands.cmd_alias_set
    t = parse("token", "create", "fleet", "--role", "read")
    assert (t.name, t.role) == ("fleet", "read")
    w = parse("worker", "compile", "--device", "cpu", "--concurrency", "2")
    assert (w.kind, w.device, w.concurrency) == ("compile", "cpu", 2)
    assert parse("db", "upgrade").revision == "head"
    assert parse("db", "downgrade", "-1").revision == "-1"
    s = parse("serve", "--embedded", "--port", "9000")
    assert s.embedded and s.port == 9000
    f = parse("fetch", "m", "-i", "float32[1]", "-o", "out.bin")
    assert f.output == Path("out.bin")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", "m:f", "--name", "n", "--version", "1", "-i", "float32[8]",
          "--kwargs", "{bad"], "--kwargs: not valid JSON"),
        (["submit", "m:f", "--name", "n", "--version", "1", "-i", "float32[8]",
          "--kwargs", "[1, 2]"], "must be a JSON object"),
        (["submit", "m:f", "--name", "n", "--version", "1", "-i", "float33[8]"],
         "unknown dtype"),
        (["submit", "m:f", "--name", "n", "--version", "1", "-i", "float32[1..4]"],
         "starts below 2"),
        (["submit", "m:f", "--name", "n", "--version", "1"], "required: --input"),
        (["submit", "not an entrypoint", "--name", "n", "--version", "1", "-i", "float32[8]"],
         "bad entrypoint"),
        (["submit", "m:f", "--name", "bad name", "--version", "1", "-i", "float32[8]"],
         "bad model name"),
        (["submit", "m:f", "--name", "n", "--version", "1", "-i", "float32[8]",
          "--target", "gpu"], "unknown"),
        (["resolve", "llama@", "-i", "float32[8]"], "after '@' is empty"),
        (["resolve", "llama", "-i", "float32[8]", "--target", "cpu"], "incomplete target"),
        (["nosuchcommand"], "invalid choice"),
        (["status"], "required"),
        ([], "required"),
        (["models", "--bogus"], "unrecognized arguments"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("farm: error: ")
    assert needle in lines[0]
    assert "Traceback" not in err


def test_unreachable_farm_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "--url", "http://127.0.0.1:9", "models")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("farm: error: cannot reach the farm")


def test_json_output_is_one_document(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Fake:
        def models(self) -> list[dict[str, object]]:
            return [{"name": "m", "versions": [], "aliases": {}}]

    monkeypatch.setattr(commands, "farm_client", lambda args: Fake())
    code, out, err = run_cli(capsys, "models", "--json")
    assert code == 0 and err == ""
    assert json.loads(out) == [{"name": "m", "versions": [], "aliases": {}}]


def test_demo_gets_its_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen: list[list[str]] = []
    fake = types.ModuleType("farm.app.demo")

    def demo_main(argv: list[str]) -> int:
        seen.append(argv)
        return 0

    fake.main = demo_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "farm.app.demo", fake)
    assert cli.main(["demo", "--keep", "--size", "small"]) == 0
    assert seen == [["--keep", "--size", "small"]]


def test_farm_help_works() -> None:
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for command in ("serve", "submit", "status", "resolve", "fetch", "prefetch", "models",
                    "targets", "alias", "token", "worker", "db", "demo"):
        assert command in r.stdout
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", "submit", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--kwargs" in r.stdout


def test_submit_wait_shows_progress_and_fails_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"
    views = [
        {"id": "j1", "state": "running", "builds": [{"target": target, "state": "compiling"}]},
        {"id": "j1", "state": "failed", "model": "m", "version": "1",
         "builds": [{"target": target, "state": "failed", "error": "graph break\nat line 3"}]},
    ]

    class Fake:
        def submit(self, spec: object, *, source: object = None) -> dict[str, str]:
            return {"id": "j1", "state": "queued"}

        def wait(self, job_id: str, timeout: float | None, *, on_progress: object) -> object:
            for v in views:
                on_progress(v)  # type: ignore[operator]
            return views[-1]

    monkeypatch.setattr(commands, "farm_client", lambda args: Fake())
    code, out, err = run_cli(capsys, "submit", "m:f", "--name", "m", "--version", "1",
                             "-i", "float32[8]", "--wait")
    assert code == 1
    lines = err.strip().splitlines()
    # One plain line per stage change (stderr is not a terminal here).
    assert lines[0].startswith("job j1: running")
    assert lines[1].startswith("job j1 cpu avx2 x2: compiling")
    assert lines[-1] == "farm: error: job j1 failed: graph break"
    assert "failed" in out and "Traceback" not in err


def test_resolve_miss_lists_rejections_then_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from farm.node.errors import NotFoundError

    class Fake:
        def resolve(self, *a: object, **kw: object) -> object:
            raise NotFoundError("no artifact of m@1 fits this node", rejections=[
                {"digest": "ab" * 32, "format": "aoti", "target": "cpu", "code": "isa",
                 "reason": "built for avx512, this node runs avx2"}])

    monkeypatch.setattr(commands, "farm_client", lambda args: Fake())
    code, out, err = run_cli(capsys, "resolve", "m@1", "-i", "float32[8]", "--target",
                             "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2")
    assert code == 1
    assert "built for avx512" in out
    assert err.strip() == "farm: error: no artifact of m@1 fits this node"


def test_a_server_command_on_a_node_install_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def serve(args: object) -> int:
        raise ModuleNotFoundError("No module named 'sqlalchemy'", name="sqlalchemy")

    monkeypatch.setattr(commands, "cmd_serve", serve)
    code, _, err = run_cli(capsys, "serve")
    assert code == 1
    assert err.strip() == ("farm: error: farm serve needs the farm's server packages (no module "
                           "named 'sqlalchemy' here): pip install torch-farm-server (from a "
                           "clone: pip install ./server)")
