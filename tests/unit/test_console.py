"""The CLI's build progress (rich on a terminal, a line per stage change when
piped) and tables."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from farm.app import console
from farm.app.console import Progress, stages

TARGET = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"


def view(state: str, *builds: tuple[str, str | None]) -> dict[str, object]:
    return {"id": "0123456789abcdef", "state": state,
            "builds": [{"target": TARGET, "state": s, "stage": st} for s, st in builds]}


SEQUENCE = [
    view("queued"),
    view("tracing"),
    view("tracing"),  # polled again: no new line
    view("compiling", ("queued", None)),
    view("compiling", ("running", "compiling")),
    view("compiling", ("running", "verifying aoti")),
    view("compiling", ("running", "verifying aoti")),
    view("compiling", ("running", "storing aoti (ok)")),
    view("succeeded", ("succeeded", None)),
]


def test_stages_name_the_job_then_each_build_by_its_short_target() -> None:
    assert stages(view("tracing")) == [("job 01234567", "tracing")]
    assert stages(view("compiling", ("running", "verifying aoti"))) == [
        ("job 01234567", "compiling"), ("job 01234567 cpu avx2 x2", "verifying aoti")]
    # A running build that has not reported a stage yet says so.
    assert stages(view("compiling", ("running", None)))[1][1] == "running"


def test_piped_output_is_one_plain_line_per_stage_change() -> None:
    out = io.StringIO()
    p = Progress(out)
    assert not p.tty
    for v in SEQUENCE:
        p(v)
    p.finish()
    lines = [ln.rsplit("  ", 1)[0] for ln in out.getvalue().splitlines()]
    assert lines == [
        "job 01234567: queued",
        "job 01234567: tracing",
        "job 01234567: compiling",
        "job 01234567 cpu avx2 x2: queued",
        "job 01234567 cpu avx2 x2: compiling",
        "job 01234567 cpu avx2 x2: verifying aoti",
        "job 01234567 cpu avx2 x2: storing aoti (ok)",
        "job 01234567: succeeded",
        "job 01234567 cpu avx2 x2: succeeded",
    ]
    assert all(ln.endswith("s") and "\r" not in ln for ln in out.getvalue().splitlines())


def test_terminal_output_is_a_live_display_with_each_stage_and_its_time() -> None:
    out = io.StringIO()
    term = Console(file=out, force_terminal=True, width=100, color_system=None)
    p = Progress(console=term)
    assert p.tty
    for v in SEQUENCE:
        p(v)
    p.finish()
    text = out.getvalue()
    for stage in ("tracing", "verifying aoti", "storing aoti (ok)", "succeeded"):
        assert stage in text, stage
    assert "cpu avx2 x2" in text and "0:00:0" in text  # rich's elapsed column


def test_tables_are_plain_columns_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_table(["model", "versions"], [["mlp", "1, 2"], ["[odd]", "3"]])
    out = capsys.readouterr().out
    assert "mlp" in out and "1, 2" in out
    assert "[odd]" in out  # markup in a value is printed, not interpreted

