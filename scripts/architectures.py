"""The supported-architectures table, from the architectures matrix's last run.

    .venv/bin/python scripts/architectures.py --run [--archs gpt2,bert] [-n 0]
    .venv/bin/python scripts/architectures.py            # the docs from the last results

``--run`` runs tests/integration/test_architectures.py with every row
(``FARM_TEST_ARCHS=all``, or ``--archs``): each row built from a tiny config
through a real farm (API, trace and compile workers, PostgreSQL, Redis, S3)
on both formats, verified by the farm, loaded by a fresh node process and
compared with eager. It writes bench/results/architectures.json (each row's
outcome, errors, the farm's and the node's differences from eager, and how
the run was made) and then docs/architectures.md from it; without ``--run``
only the docs are written again from that JSON. PostgreSQL and Redis must be
running (scripts/services.sh). The whole matrix takes 12 minutes or more on
a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "architectures.json"
DOC = ROOT / "docs" / "architectures.md"
TEST = "tests/integration/test_architectures.py"
FORMATS = ("aot_compile", "aoti")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "diffusers", "torchvision"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """Each row's pytest outcome (passed, failed, skipped, xfailed, xpassed) and message."""
    out: dict[str, dict[str, str]] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("test_architecture["):
            continue
        arch = name.removeprefix("test_architecture[").removesuffix("]")
        outcome, message = "passed", ""
        for child in case:
            if child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
                message = child.get("message", "")
            elif child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:2000]
        out[arch] = {"outcome": outcome, "message": message}
    return out


def run(archs: str, workers: str) -> dict[str, Any]:
    """Run the matrix; the results as written to RESULTS."""
    sys.path.insert(0, str(ROOT))
    from tests.models.archs import ARCHS

    tmp = Path(tempfile.mkdtemp(prefix="farm-archs-"))
    lines, junit = tmp / "rows.jsonl", tmp / "junit.xml"
    env = {**os.environ, "FARM_TEST_ARCHS": archs, "FARM_ARCH_RESULTS": str(lines)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        workers,
        "-p",
        "no:cacheprovider",
        "-q",
        f"--junitxml={junit}",
        TEST,
    ]
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    wall = time.monotonic() - t0
    rows = {}
    if lines.exists():
        for line in lines.read_text().splitlines():
            row = json.loads(line)
            rows[row["arch"]] = row
    outcomes = _outcomes(junit)
    table = []
    wanted = None if archs == "all" else set(archs.split(","))
    for a in ARCHS:
        if wanted is not None and a.name not in wanted:
            continue
        row = rows.get(
            a.name,
            {
                "arch": a.name,
                "family": a.family,
                "traits": a.traits,
                "inputs": list(a.inputs),
                "formats": {},
            },
        )
        row.update(
            library=a.library,
            expected_failures=dict(a.fails),
            **outcomes.get(a.name, {"outcome": "not run", "message": ""}),
        )
        table.append(row)
    return {
        "generated_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "command": f"FARM_TEST_ARCHS={archs} pytest -n {workers} {TEST}",
        "pytest_exit": rc,
        "wall_s": round(wall, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(),
        "rows": table,
    }


def merged(last: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """The last full run with the rows run again replaced, and that said."""
    again = {r["arch"]: r for r in rerun["rows"]}
    rows = [again.pop(r["arch"], r) for r in last["rows"]] + list(again.values())
    for name in {r["arch"] for r in rerun["rows"]}:
        next(r for r in rows if r["arch"] == name)["rerun_at"] = rerun["generated_at"]
    reruns = [
        *last.get("reruns", []),
        {k: rerun[k] for k in ("generated_at", "command", "pytest_exit", "wall_s")},
    ]
    return {**last, "rows": rows, "reruns": reruns}


def _cell(row: dict[str, Any], fmt: str) -> str:
    info = (row.get("formats") or {}).get(fmt)
    if row.get("outcome") == "skipped":
        return "skipped"
    if not info:
        return "not run"
    if "error" in info:
        expected = (row.get("expected_failures") or {}).get(fmt)
        if expected and expected in str(info["error"]):
            return f"no, in torch: {expected}"
        # Paths of this machine's install say nothing to a reader.
        why = re.sub(r"\S*/(site|dist)-packages/", "", str(info["error"]).splitlines()[0])
        return "no: " + why[:200].replace("|", "\\|")
    if info.get("verified") and info.get("node_ok"):
        return f"yes ({info['node_max_abs_err']:.1e})"
    return "built, does not match eager"


def render(data: dict[str, Any]) -> str:
    v = data["versions"]
    out = [
        "# Supported architectures",
        "",
        "Generated by `scripts/architectures.py` from the last run of the architectures "
        "matrix (`bench/results/architectures.json`); do not edit by hand.",
        "",
        f"Run {data['generated_at']}: torch {v['torch']}, transformers {v['transformers']}, "
        f"diffusers {v['diffusers']}, torchvision {v['torchvision']}, Python {v['python']}, "
        f"CPU ({data['machine']['cpus']} cores); `{data['command']}`, "
        f"{data['wall_s'] / 60:.1f} min, pytest exit {data['pytest_exit']}.",
        "",
        "Each row is a model family built from a tiny config (random weights, nothing "
        "downloaded; tests/models/archs.py) and submitted to a real farm, which traces it, "
        "compiles both formats on CPU and verifies each against eager; a fresh node process "
        "then resolves, fetches and attestation-checks the artifact, loads it against a module "
        "it built as its user would (the library's own weight tying) and compares with eager. "
        "A cell says whether that format works there, with the node's largest absolute "
        "difference from eager, or the error (torch's own, where torch cannot build it).",
        "",
        "| architecture | family | what it covers | aot_compile | AOTInductor | result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["rows"]:
        result = row.get("outcome", "not run")
        if result == "xfailed":
            result = "expected failure (torch)"
        elif result == "skipped":
            result = f"skipped: {row.get('message', '')}"
        out.append(
            f"| {row['arch']} | {row['family']} | {row['traits']} | {_cell(row, 'aot_compile')} "
            f"| {_cell(row, 'aoti')} | {result} |"
        )
    counts: dict[str, int] = {}
    for row in data["rows"]:
        counts[row.get("outcome", "not run")] = counts.get(row.get("outcome", "not run"), 0) + 1
    for r in data.get("reruns", []):
        out += [
            "",
            f"Rows run again {r['generated_at']}: `{r['command']}`, "
            f"{r['wall_s'] / 60:.1f} min, pytest exit {r['pytest_exit']}.",
        ]
    out += [
        "",
        "Outcomes: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ".",
        "",
        "Run it again: `bash scripts/services.sh && .venv/bin/python "
        "scripts/architectures.py --run`; CI runs the rows marked `ci` in "
        "tests/models/archs.py (`FARM_TEST_ARCHS=all` runs every row).",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run the matrix first (12+ minutes)")
    p.add_argument("--archs", default="all", help="rows to run: all, or names (a,b)")
    p.add_argument("-n", dest="workers", default="0", help="pytest-xdist workers (0: none)")
    a = p.parse_args()
    if a.run:
        data = run(a.archs, a.workers)
        if a.archs != "all" and RESULTS.exists():
            data = merged(json.loads(RESULTS.read_text()), data)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    data = json.loads(RESULTS.read_text())
    DOC.write_text(render(data))
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
