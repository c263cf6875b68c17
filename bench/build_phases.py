"""Where one small CPU build's time goes: its three sandboxed children against
children that only start Python and import torch.

A farm build is three fresh processes, each under ``farm.build.sandbox``
(bubblewrap when the machine can isolate, as a worker runs them): the trace
(``farm.build.steps:trace_step``), the compile (``compile_step``'s
``compile_job``, aot_compile only, as the test suite's session farm builds)
and the verifier (``farm.build.verify.verify_artifact``). Beside them, in the
same run and the same sandbox, children that do nothing, import ``torch``,
and import ``torch``, ``torch._dynamo`` and ``torch._inductor.compile_fx``:
what a warm, forked build child no longer pays. Each round runs them twice,
side by side: as new interpreters (``FARM_BUILD_ZYGOTE=off``) and forked from
the worker's warm zygote (``farm.build.zygote``, the default); the zygotes are
started once before the first round, and that start is printed apart.

    .venv/bin/python bench/build_phases.py              # farm.zoo.basic:mlp, 3 rounds
    .venv/bin/python bench/build_phases.py --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from farm.build import zygote
from farm.build.sandbox import build_isolation, run_isolated
from farm.build.steps import compile_env
from farm.build.toolchain import compiler_for
from farm.build.verify import verify_artifact
from farm.core.settings import get_settings
from farm.core.specs import JobSpec

IMPORTS = ("import time\n"
           "def nothing(p):\n    return 0\n"
           "def torch_only(p):\n    import torch  # noqa: F401\n    return 0\n"
           "def torch_compile_stack(p):\n"
           "    import torch, torch._dynamo, torch._inductor.compile_fx  # noqa: F401, E401\n"
           "    return 0\n")
LIMIT_S, MEMORY_MB = 900, 8000
T = TypeVar("T")


def spec(entrypoint: str, inputs: list[str]) -> JobSpec:
    return JobSpec.from_json({"name": "bench", "version": "1",
                              "model": {"entrypoint": entrypoint, "kwargs": {}},
                              "inputs": inputs, "grad_mode": "inference", "options": {}})


def timed(fn: Callable[..., T], *args: Any, **kw: Any) -> tuple[float, T]:
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return time.monotonic() - t0, out


def zygotes(on: bool) -> None:
    os.environ["FARM_BUILD_ZYGOTE"] = "on" if on else "off"
    get_settings.cache_clear()


def one_round(job: JobSpec, code: Path, *, warm: bool) -> dict[str, float]:
    zygotes(warm)
    row: dict[str, float] = {}
    for name in ("nothing", "torch_only", "torch_compile_stack"):
        s, res = timed(run_isolated, f"farm_bench_imports:{name}", {}, timeout_s=LIMIT_S,
                       memory_mb=MEMORY_MB, import_paths=[code],
                       isolation=build_isolation(what="bench"))
        assert res.ok, res.describe()
        row[name] = s
    with tempfile.TemporaryDirectory(dir=zygote.work_dir()) as tmp:
        d = Path(tmp)
        s, res = timed(run_isolated, "farm.build.steps:trace_step", {"spec": job.to_json()},
                       timeout_s=LIMIT_S, memory_mb=MEMORY_MB,
                       isolation=build_isolation(what="bench"))
        assert res.ok, res.describe()
        row["trace"] = s
        s, res = timed(run_isolated, "farm.build.compile:compile_job",
                       {"spec": job.to_json(), "device": "cpu", "out_dir": str(d / "out"),
                        "cxx": compiler_for("cpu").cxx, "formats": ["aot_compile"]},
                       timeout_s=LIMIT_S, memory_mb=MEMORY_MB, env_extra=compile_env(d / "work"),
                       isolation=build_isolation(writable=(str(d),), what="bench"))
        assert res.ok, res.describe()
        row["compile"] = s
        (art,) = res.value["artifacts"]
        s, rep = timed(verify_artifact, job, art["path"], art["format"], device="cpu",
                       timeout_s=LIMIT_S, memory_mb=MEMORY_MB,
                       isolation=build_isolation(writable=(str(d),), what="bench"))
        assert rep.ok, rep.error
        row["verify"] = s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="farm.zoo.basic:mlp")
    ap.add_argument("--input", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    inputs = args.input or ["float32[4,64]"]
    job = spec(args.model, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp)
        code.chmod(0o755)  # the sandbox's uid reads it (mounted read-only)
        (code / "farm_bench_imports.py").write_text(IMPORTS)
        # The zygotes' starts (one per import-time environment: trace and
        # verify children share one, the compile child's CXX makes another).
        start, _ = timed(one_round, job, code, warm=True)
        rows = [(one_round(job, code, warm=False), one_round(job, code, warm=True))
                for _ in range(args.rounds)]
    zygote.ZYGOTES.stop_all()
    fresh = {k: statistics.median(r[0][k] for r in rows) for k in rows[0][0]}
    warm = {k: statistics.median(r[1][k] for r in rows) for k in rows[0][1]}
    print(f"{args.model} {' '.join(inputs)}, CPU, aot_compile; median of {args.rounds} rounds, "
          f"wall seconds (python {sys.version.split()[0]})")
    print(f"{'child':<44} {'fresh s':>8} {'zygote s':>9} {'ratio':>6}")
    for key, label in (("trace", "trace"), ("compile", "compile (aot_compile)"),
                       ("verify", "verify"),
                       ("nothing", "a child that does nothing"),
                       ("torch_only", "a child that imports torch"),
                       ("torch_compile_stack", "... torch, _dynamo, _inductor.compile_fx")):
        print(f"{label:<44} {fresh[key]:>8.1f} {warm[key]:>9.1f} {warm[key] / fresh[key]:>6.2f}")
    fb = fresh["trace"] + fresh["compile"] + fresh["verify"]
    wb = warm["trace"] + warm["compile"] + warm["verify"]
    print(f"{'build (the three)':<44} {fb:>8.1f} {wb:>9.1f} {wb / fb:>6.2f}")
    print(f"first round with zygotes, their starts included: {start:.1f} s")


if __name__ == "__main__":
    main()
