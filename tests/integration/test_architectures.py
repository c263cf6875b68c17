"""The architectures matrix: real model families from tiny configs
(tests/models/archs.py, nothing downloaded), each one test, through the real
farm (API, trace and compile workers, PostgreSQL, Redis, S3) on both formats
(aot_compile and an AOTInductor package), each artifact verified by the farm,
then resolved, fetched, attestation-checked and loaded by a fresh node
process whose module is built as its user builds it (the library's own init
and weight tying) and compared with eager.

By default CI runs the representative rows (``Arch.ci``: GPT-2's tied
embeddings, T5's shared encoder embedding, BERT's index buffers);
``FARM_TEST_ARCHS=all`` runs every row, ``FARM_TEST_ARCHS=gpt2,t5`` those
named (scripts/architectures.py --run does, and writes docs/architectures.md
from the results). A row whose library does not import is skipped with why.
A format torch itself cannot build for a family is listed in its row
(``Arch.fails``) with torch's error: the test checks the farm reports that
error and everything else of the row works, then xfails (strict: a torch that
can build it makes the row fail until the entry goes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import ROOT, Farm
from tests.fixtures.node import node_python
from tests.models.archs import ARCHS, BY_NAME, Arch, unavailable
from tests.slowdown import scaled

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
    ),
]

NODE = Path(__file__).with_name("arch_node.py")
FORMATS = ("aot_compile", "aoti")
# Each result as one JSON line, where scripts/architectures.py reads them.
RESULTS = os.environ.get("FARM_ARCH_RESULTS")


class TorchCannotBuild(Exception):
    """The row's expected failure: torch's own error for a format (``Arch.fails``)."""


def selected() -> list[Arch]:
    """The rows this run builds: FARM_TEST_ARCHS (``all``, or names), else CI's."""
    wanted = os.environ.get("FARM_TEST_ARCHS", "").strip()
    if wanted == "all":
        return list(ARCHS)
    if wanted:
        unknown = [n for n in wanted.split(",") if n not in BY_NAME]
        if unknown:
            raise pytest.UsageError(
                f"FARM_TEST_ARCHS: unknown {unknown}; known: {', '.join(BY_NAME)}"
            )
        return [BY_NAME[n] for n in wanted.split(",")]
    return [a for a in ARCHS if a.ci]


def _param(a: Arch) -> Any:
    marks = []
    why = unavailable(a)
    if why is not None:
        marks.append(pytest.mark.skip(reason=why))
    elif a.fails:
        reason = "; ".join(f"{fmt}: {err}" for fmt, err in a.fails.items())
        marks.append(pytest.mark.xfail(strict=True, raises=TorchCannotBuild, reason=reason))
    return pytest.param(a.name, marks=marks, id=a.name)


def job(a: Arch) -> dict[str, Any]:
    return {
        "name": f"arch-{a.name}",
        "version": "1",
        "model": {"entrypoint": "tests.models.archs:build", "kwargs": {"arch": a.name}},
        "inputs": list(a.inputs),
        "targets": ["cpu"],
    }


@pytest.fixture(scope="module")
def arch_farm(aoti_farm: Farm) -> Farm:
    """A farm as deployed by default: both formats (FARM_AOTI=1). The
    session's, shared with test_pipeline and test_attestation
    (tests/conftest.py sends the three to one xdist worker): a farm of its
    own cost the run one more start (an API, two workers, their zygotes)."""
    return aoti_farm


@pytest.fixture(scope="module")
def arch_jobs(arch_farm: Farm) -> Iterator[dict[str, str]]:
    """Every selected row submitted at once: the trace worker traces the next
    rows while the compile worker builds one."""
    runnable = [a for a in selected() if unavailable(a) is None]
    yield {a.name: arch_farm.submit(job(a)) for a in runnable}


def node(farm: Farm, a: Arch, fmt: str) -> dict[str, Any]:
    out = subprocess.run(
        [*node_python(), str(NODE), "--model", f"arch-{a.name}", "--arch", a.name, "--format", fmt],
        env={**farm.env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def close(got: dict[str, Any]) -> bool:
    return bool(got["max_abs_err"] <= 1e-4 * (1.0 + got["ref_max"]))


def record(row: dict[str, Any]) -> None:
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")


def failed_formats(j: dict[str, Any]) -> dict[str, str]:
    """What the farm says of each format it did not keep (failed at compile
    or verify, or skipped by this host), and of a build that failed whole."""
    out: dict[str, str] = {}
    for b in j.get("builds") or []:
        for fmt, why in (b.get("formats_failed") or {}).items():
            out[fmt] = str(why.get("reason") if isinstance(why, dict) else why)
        for fmt, why in (b.get("formats_skipped") or {}).items():
            out.setdefault(fmt, f"skipped: {why}")
        if b.get("error"):
            out.setdefault("build", str(b["error"]))
    if j.get("error"):
        out.setdefault("build", str(j["error"]))
    return out


@pytest.mark.parametrize("name", [_param(a) for a in selected()])
def test_architecture(name: str, arch_farm: Farm, arch_jobs: dict[str, str]) -> None:
    a = BY_NAME[name]
    t0 = time.monotonic()
    j = arch_farm.wait_job(arch_jobs[name], timeout=1800)
    row: dict[str, Any] = {
        "arch": a.name,
        "family": a.family,
        "traits": a.traits,
        "inputs": list(a.inputs),
        "state": j["state"],
        "formats": {},
    }
    built = {art["format"]: art for b in j.get("builds") or [] for art in b.get("artifacts") or []}
    failed = failed_formats(j)
    try:
        for fmt in FORMATS:
            info: dict[str, Any] = {}
            row["formats"][fmt] = info
            art = built.get(fmt)
            if art is None:
                info["error"] = failed.get(fmt) or failed.get("build") or "not built"
                continue
            rep = art["meta"]["verify"]
            info.update(
                verified=bool(rep["ok"]),
                farm_max_abs_err=rep.get("max_abs_err"),
                trace_and_lower_s=art["meta"].get("trace_and_lower_s"),
            )
            got = node(arch_farm, a, fmt)
            info.update(
                node_max_abs_err=got["max_abs_err"], node_ok=close(got), node_seconds=got["seconds"]
            )
        row["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        record(row)
    for fmt in FORMATS:
        info = row["formats"][fmt]
        if fmt in a.fails:
            continue
        assert "error" not in info, (
            f"{a.name} {fmt}: {info['error']}\n" + json.dumps(j, indent=1)[:6000]
        )
        assert info["verified"] and info["node_ok"], (a.name, fmt, info)
    if a.name == "gpt2":
        # The case: the head tied to the embedding, one tensor under two
        # names in the signed manifest, and a node whose module ties them loads.
        manifest = built["aot_compile"]["meta"]["weights_manifest"]
        head = next(e for e in manifest if e["name"] == "model.lm_head.weight")
        assert head["tensor"] == "model.transformer.wte.weight"
    for fmt, expected in a.fails.items():
        info = row["formats"][fmt]
        assert "error" in info, f"{a.name} {fmt} now builds: drop it from Arch.fails ({info})"
        assert expected in info["error"], (fmt, info["error"])
        raise TorchCannotBuild(f"{fmt}: {info['error']}")
