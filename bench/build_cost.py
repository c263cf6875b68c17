"""What a build costs when the target's shared compile cache is warm (issue 18).

Runs the compile worker's compile step directly, no farm servers: each build is
``farm.build.steps:compile_step`` in a sandboxed child, with the cache
wiring of ``workers.tasks`` (``farm.build.compile_cache``: the worker prefills
the child's Inductor/Triton cache directories from the target's namespace and
harvests what it added), over a directory store, so it needs no Redis.

Cases, each after the ones before it (the store keeps what they compiled):

  cold                    16 residual layers, an empty store
  second mode             the same model, grad mode training (or --second-mode)
  one of 16 layers        a new version whose layer 7 uses SiLU instead of GELU
  new input shape         the batch doubled
  same graph, new key     the cold case's graph under another build key
                          (disable_guard_check): torch's AOTAutograd cache
                          answers it (farm.build.graph_identity)
  identical resubmission  the farm traces again and finds the same build key, so
                          it links the existing artifact: no compile. Checked
                          here by tracing both in fresh children and comparing
                          build keys (farm.core.specs.build_key)

Printed: the compile child's wall seconds (its start and imports included),
the ratio to cold, entries prefilled and shared, and under each case the
child's own split of its seconds (``farm.build.stage_times``). By default each
child forks from a warm build zygote, with its build directory in the
zygote's slot, as a compile worker runs it (``farm.build.zygote``; the
zygote's own start, once per worker process, is printed apart);
``--fresh`` starts every child as a new interpreter. ``--graph-check`` adds
the fingerprint check a worker's child runs (a second trace). aot_compile
only, unless ``--aoti``: each inference build makes the AOTI package too, as
a worker does, and its seconds get a column of their own (a package comes
from the cache where its exported program, configs and toolchain are the
same: farm.build.aoti_cache).

    .venv/bin/python bench/build_cost.py                  # CPU
    .venv/bin/python bench/build_cost.py --fresh          # CPU, no warm child
    .venv/bin/python bench/build_cost.py --aoti           # CPU, AOTI packages too
    .venv/bin/python bench/build_cost.py --device cuda    # the H200
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build import zygote  # noqa: E402
from farm.build.compile_cache import CacheSession, DirCacheStore, namespace  # noqa: E402
from farm.build.sandbox import build_isolation, run_isolated  # noqa: E402
from farm.build.stage_times import describe  # noqa: E402
from farm.build.steps import compile_env  # noqa: E402
from farm.build.toolchain import compiler_for  # noqa: E402
from farm.core.specs import JobSpec, build_key  # noqa: E402


def spec(*, layers: int, width: int, batch: int, changed: int = -1,
         grad_mode: str = "inference", mode: str = "default", version: str = "1",
         options: dict[str, Any] | None = None, distinct: bool = False) -> JobSpec:
    kwargs: dict[str, Any] = {"layers": layers, "width": width, "changed": changed}
    if distinct:
        kwargs["distinct"] = True
    return JobSpec.from_json({
        "name": "build-cost", "version": version,
        "model": {"entrypoint": "farm.zoo.stack:stack", "kwargs": kwargs},
        "inputs": [f"float32[{batch},{width}]"], "grad_mode": grad_mode,
        "options": {**(options or {}), "mode": mode}})


def compile_once(job: JobSpec, *, device: str, store: DirCacheStore, ns: str,
                 work: Path, timeout_s: float, env: dict[str, str] | None = None,
                 warm: bool = True, fingerprint: str | None = None,
                 aoti: bool = False) -> dict[str, Any]:
    work.mkdir(parents=True)
    cache = CacheSession(store, ns, work)
    cache.prefill()
    payload = {
        "spec": job.to_json(), "device": device, "out_dir": str(work / "out"),
        # A worker's answers: whether AOTI builds here (None: it does), and
        # which compiler its children run (its first choice can take a minute
        # on a GPU host: chosen before the clock starts, as a worker does at
        # its start).
        "aoti_unavailable": (None if aoti and job.grad_mode.value == "inference" else
                             "bench/build_cost.py measures aot_compile"),
        **({"cxx": compiler_for(device).cxx} if aoti else {}),
        **({"fingerprint": fingerprint} if fingerprint else {})}
    t0 = time.perf_counter()
    res = run_isolated(
        "farm.build.steps:compile_step", payload,
        timeout_s=timeout_s, memory_mb=16000, env_extra={**compile_env(work), **(env or {})},
        isolation=build_isolation(writable=(str(work),), mode="auto"), warm=warm)
    # The child's own wall time; what run_isolated spent before it (a
    # zygote's start, once per worker process) is reported apart.
    wall = res.wall_s
    overhead = time.perf_counter() - t0 - wall
    if not res.ok:
        raise SystemExit(f"compile failed: {res.error_type}: {res.error}\n{res.stderr_tail}")
    cache.harvest()
    assert res.value is not None
    # torch.compile's own seconds in the child (farm.build.compile), without
    # the Python start, the imports and the fingerprint check around it.
    torch_s = sum(float(a["meta"].get("compile_s") or 0) for a in res.value["artifacts"])
    aot_cache = ",".join(sorted({str(a["meta"].get("aot_autograd_cache", "-"))
                                 for a in res.value["artifacts"]}))
    # The AOTI package's own seconds, and whether it came from the cache.
    aoti = [a["meta"] for a in res.value["artifacts"] if a["format"] == "aoti"]
    aoti_s = float(aoti[0].get("compile_s") or 0) if aoti else None
    aoti_hit = bool(aoti and (aoti[0].get("package_cache") or {}).get("hit"))
    # Where the zygote's start went, when this child waited for it.
    phases = {k: v for k, v in res.zygote_start.items() if k != "total"}
    return {"s": wall, "torch_s": torch_s, "overhead_s": overhead, "warm": res.warm,
            "stages": res.stages, "aot_cache": aot_cache, "zygote_phases": phases,
            "aoti_s": aoti_s, "aoti_hit": aoti_hit,
            **cache.stats}


def fingerprint(job: JobSpec, *, timeout_s: float) -> tuple[str, float]:
    t0 = time.perf_counter()
    res = run_isolated("farm.build.steps:trace_step", {"spec": job.to_json()},
                       timeout_s=timeout_s, memory_mb=16000,
                       isolation=build_isolation(mode="auto"))
    if not res.ok or res.value is None:
        raise SystemExit(f"trace failed: {res.error_type}: {res.error}")
    return str(res.value["fingerprint"]), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--second-mode", default="training",
                    help="training (the grad mode), or a torch.compile mode "
                         "(e.g. max-autotune-no-cudagraphs)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a compile option for every build, e.g. regional=true")
    ap.add_argument("--distinct", action="store_true",
                    help="layers of distinct hidden widths (farm.zoo.stack distinct=True): "
                         "each compiles kernels of its own")
    ap.add_argument("--no-header-store", action="store_true",
                    help="compile kernels without this machine's precompiled headers "
                         "(farm.build.pch), as builds did before")
    ap.add_argument("--fresh", action="store_true",
                    help="start every compile child as a new interpreter (no warm zygote)")
    ap.add_argument("--graph-check", action="store_true",
                    help="pass each build's fingerprint, so the child checks its graph "
                         "(a second trace) as a worker's child does")
    ap.add_argument("--aoti", action="store_true",
                    help="inference builds make the AOTI package too, as a worker does")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()

    if args.no_header_store:
        os.environ["FARM_PCH_STORE"] = "off"
    import torch

    from farm.build import pch
    from farm.core.target import detect_local_target

    # Once per machine and toolchain, as a compile worker does at its start:
    # not part of any build. A worker that builds AOTI packages has chosen
    # its compiler by then (farm.build.aoti_check), and the store's AOTI
    # headers are for that compiler only.
    if args.aoti:
        compiler_for(args.device)
    t0 = time.perf_counter()
    # As a worker fills it: the sample AOTI package only for CPU packages.
    filled = pch.fill_store(aoti=pch.wants_aoti_sample(args.device, args.aoti))
    headers = ("off" if args.no_header_store else
               pch.describe_fill(filled, time.perf_counter() - t0))

    from farm.build import bytecode

    bytecode_state = bytecode.fill_now()
    target = str(detect_local_target(args.device))
    options = dict(o.split("=", 1) for o in args.option)
    base: dict[str, Any] = {"layers": args.layers, "width": args.width, "batch": args.batch,
                            "options": options, "distinct": args.distinct}
    second = ({"grad_mode": "training"} if args.second_mode == "training"
              else {"mode": args.second_mode})
    cases = [
        ("cold", spec(**base)),
        (f"second mode ({args.second_mode})", spec(**base, **second)),
        (f"one of {args.layers} layers changed", spec(**base, changed=args.layers // 2 - 1,
                                                       version="2")),
        ("new input shape", spec(**{**base, "batch": args.batch * 2})),
        # Another build key for the very graph of the cold case (skipping the
        # guard check is an option of the key and of the loader, not of the
        # graph): torch's AOTAutograd cache answers it (farm.build.graph_identity).
        ("same graph, new build key", spec(**{**base, "options": {
            **options, "disable_guard_check": True}})),
    ]
    lines = [
        f"# bench/build_cost.py {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"# target {target}",
        f"# torch {torch.__version__}, python {platform.python_version()}; model "
        f"farm.zoo.stack:stack layers={args.layers} width={args.width} batch={args.batch}"
        f"{' distinct=True' if args.distinct else ''}"
        f"{' options ' + str(options) if options else ''}",
        "# run: the compile step called directly (no farm servers), in sandboxed children, "
        "with the worker's cache wiring over a directory store; "
        f"{'aot_compile and, for inference, AOTI' if args.aoti else 'aot_compile only'}",
        "# build s: the compile child's wall time; torch s: torch.compile's part of it; "
        f"precompiled headers {headers}; load average "
        f"{os.getloadavg()[0]:.1f} at the start",
        f"# bytecode for build children: {bytecode_state}",
        f"# children: {'new interpreters (--fresh)' if args.fresh else 'forked from a warm zygote'}"
        f"; graph check {'on' if args.graph_check else 'off'}",
        f"{'case':<32} {'build s':>8} {'vs cold':>8} {'torch s':>8} {'vs cold':>8} "
        f"{'prefilled':>9} {'shared':>7}" + (f" {'aoti s':>8}" if args.aoti else ""),
    ]
    print("\n".join(lines), flush=True)
    work_root = None if args.fresh else zygote.work_dir()
    with tempfile.TemporaryDirectory(prefix="build-cost-", dir=work_root) as tmp:
        store = DirCacheStore(Path(tmp) / "store")
        ns = namespace(target, "bench")
        cold_s = cold_torch = 0.0
        env = None
        for i, (name, job) in enumerate(cases):
            fp = fingerprint(job, timeout_s=args.timeout_s)[0] if args.graph_check else None
            r = compile_once(job, device=args.device, store=store, ns=ns,
                             work=Path(tmp) / f"b{i}", timeout_s=args.timeout_s, env=env,
                             warm=not args.fresh, fingerprint=fp, aoti=args.aoti)
            cold_s, cold_torch = cold_s or r["s"], cold_torch or r["torch_s"]
            line = (f"{name:<32} {r['s']:>8.1f} {r['s'] / cold_s:>8.0%} "
                    f"{r['torch_s']:>8.1f} {r['torch_s'] / cold_torch:>8.0%} "
                    f"{r['prefilled']:>9} {r['shared']:>7}")
            if args.aoti:
                line += (f" {'-':>8}" if r["aoti_s"] is None else
                         f" {r['aoti_s']:>8.1f}{' (from the cache)' if r['aoti_hit'] else ''}")
            how = "warm" if r["warm"] else "fresh"
            split = (f"{'':4}{how} child, AOTAutograd cache {r['aot_cache']}: "
                     f"{describe(r['stages'])}")
            if r["overhead_s"] > 1.0:
                split += (f"; before the child: {r['overhead_s']:.1f} s (the zygote's start: "
                          f"{describe(r['zygote_phases'])})")
            print(line, split, sep="\n", flush=True)
            lines += [line, split]
        # Identical resubmission: the registry dedupes on the build key.
        keys, trace_s = [], []
        for _ in range(2):
            fp, s = fingerprint(cases[0][1], timeout_s=args.timeout_s)
            j = cases[0][1]
            keys.append(build_key(fingerprint=fp, inputs=j.inputs, grad_mode=j.grad_mode,
                                  options=j.options, target=target))
            trace_s.append(s)
        if keys[0] != keys[1]:
            raise SystemExit("identical resubmission: the build keys differ; the farm "
                             "would compile it again")
        line = (f"{'identical resubmission':<32} {0.0:>8.1f} {0:>8.0%} {0.0:>8.1f} {0:>8.0%} "
                f"{'-':>9} {'-':>7}  (same build key: reused; its trace took "
                f"{trace_s[1]:.1f} s)")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
