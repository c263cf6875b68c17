"""What a build zygote's imports cost where Python keeps no bytecode, with and
without the worker's compiled bytecode (farm.build.bytecode).

A host whose Python keeps none (PYTHONDONTWRITEBYTECODE=1 and no .pyc files,
as on the lent GPU image) is simulated here: every timed process runs with
PYTHONDONTWRITEBYTECODE=1 and a PYTHONPYCACHEPREFIX, which makes Python look
for bytecode only there. Rows, alternating, each a fresh process importing
what a build zygote preloads (farm.build.zygote.PRELOADS["build"]):

  none    the prefix is an empty directory: every module compiled from source
  filled  the prefix ``farm.build.bytecode.fill`` filled (timed once, first)
  beside  no prefix: the .pyc files of this byte-compiled installation, as
          on a machine whose Python keeps bytecode (the bound to aim at)

    .venv/bin/python bench/bytecode_cache.py --rounds 3 --out FILE
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from farm.build import bytecode
from farm.build.zygote import PRELOADS

IMPORTS = "import " + ", ".join(PRELOADS["build"])


def timed_import(prefix: Path | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if prefix is not None:
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=True, timeout=600)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bytecode-bench-") as tmp:
        empty, filled = Path(tmp) / "empty", Path(tmp) / "filled"
        empty.mkdir()
        fill = bytecode.fill(filled)
        if "error" in fill:
            raise SystemExit(f"fill failed: {fill}")
        rows: dict[str, list[float]] = {"none": [], "filled": [], "beside": []}
        for _ in range(args.rounds):
            rows["none"].append(timed_import(empty))
            rows["filled"].append(timed_import(filled))
            rows["beside"].append(timed_import(None))
        size_mb = sum(f.stat().st_size for f in filled.rglob("*.pyc")) / 2**20
    lines = [
        f"# bench/bytecode_cache.py {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f} at the end",
        f"# timed: a fresh `python -c \"{IMPORTS}\"` with PYTHONDONTWRITEBYTECODE=1",
        f"fill (once per machine): {fill['s']} s, {size_mb:.0f} MB of .pyc, "
        f"dirs {', '.join(fill['dirs'])}",
        "bytecode   median s   rounds",
    ]
    for name, xs in rows.items():
        lines.append(f"{name:<10} {statistics.median(xs):>8.2f}   "
                     + ", ".join(f"{x:.2f}" for x in xs))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
