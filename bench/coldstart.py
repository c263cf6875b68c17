"""A fleet node's cold start: time from process start to the first result.

    .venv/bin/python bench/coldstart.py [--device cpu] [--model transformer|mlp|bench]
                                        [--repeats 2] [--steady-calls 20]

In one run: compile the farm's artifacts for this machine (in a sandboxed
child, as a compile worker does), then measure each way of getting a first
result in its own fresh process, rounds interleaved so a busy host slows every
way alike:

cpu (issue 3)
  eager             no compile
  jit               ``torch.compile`` with an empty Inductor cache, g++ present
  jit+megacache     the same after ``torch.compiler.load_cache_artifacts`` of
                    the bytes a jit run saved
  farm aoti         the farm's CPU artifact on a cold node: empty Inductor
                    cache and no C/C++ compiler on PATH (checked in the child)
  farm aot_compile  the raw ``aot_compile`` artifact, empty cache, g++ present
  farm aot_compile, no compiler   expected to fail: it recompiles C++ at load

cuda, with --farm-url (scripts/gpu_check.sh on the H200)
  eager, jit, optionally jit+megacache and jit max-autotune-no-cudagraphs, and
  the fleet path through the registry (resolve, download, verify, load) for
  each --farm-models name with the farm's defaults (the resolver picks the
  format) and optionally per --farm-formats; with --farm-train-models, an
  eager training row and a fleet row per training model (first result: a
  forward and a backward). --budget-s stops before a round that would not
  fit, and the table is written after every round.

--agent (with --farm-train-models): the training rows again, each run through
  ``python -m farm.node.run`` in a fork of a node agent (farm.node.agent) that
  has torch, Dynamo and Inductor imported; the agent is started once before the
  rounds (its start is reported apart), and these rows count from the
  ``farm run`` client's process start.

Prints a table of seconds, ratios against JIT and eager, CPU seconds and steady
per-call times, and writes it to bench/results/coldstart-<device>-<date>.txt.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build.child_env import compilers_on_path, without_compilers  # noqa: E402
from farm.build.sandbox import run_isolated  # noqa: E402
from farm.core.specs import JobSpec  # noqa: E402

MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (entrypoint, kwargs, input spec)
    "transformer": ("farm.zoo.basic:small_transformer", {}, "float32[4,64,128]"),
    "mlp": ("farm.zoo.basic:mlp", {}, "float32[8,64]"),
    "bench": ("farm.zoo.basic:bench_transformer", {}, "bfloat16[8,512,1024]"),
}
TIMEOUT_S = 900
MEMORY_MB = 16000


def job(model: str, *, mode: str = "default") -> JobSpec:
    entry, kwargs, inputs = MODELS[model]
    return JobSpec.from_json(
        {
            "name": f"coldstart-{model}",
            "version": "1",
            "model": {"entrypoint": entry, "kwargs": kwargs},
            "inputs": [inputs],
            "options": {"mode": mode},
        }
    )


# --- the child: one way to a first result ---------------------------------------------


def scenario(payload: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process (farm.build.sandbox). Times count from the process's start."""
    import resource

    import psutil

    started = psutil.Process().create_time()
    import torch

    t_import = time.time()
    from farm.core.modelref import apply_grad_mode, build_module, example_inputs
    from farm.core.specs import GradMode

    spec = JobSpec.from_json(payload["spec"])
    device = payload["device"]
    kind = payload["kind"]
    # Training: the first result is a forward and a backward (the step's
    # gradients), under grad mode with the module in train().
    training = payload.get("grad_mode") == "training"
    grad_mode = GradMode.TRAINING if training else GradMode.INFERENCE
    handle = None
    if kind == "fleet":
        # The fleet node's path: start resolve, download, verification and the
        # imports loading needs in the background, then load the weights (here:
        # build the model) as the node does anyway, then bind. The client is
        # the node's default one (FARM_URL, set by run_child), made and
        # imported in the background as a node's is.
        from farm.node.compiled import prefetch_compiled

        handle = prefetch_compiled(
            model=payload["farm_model"],
            ref="1",
            example_inputs=[str(x) for x in spec.inputs],
            grad_mode=grad_mode.value,
            device=device.split(":")[0],
            formats=payload.get("farm_formats"),
            warm_imports=payload.get("warm_imports", True),
        )
    model = build_module(spec.model, device=device, seed=0)
    apply_grad_mode(model, grad_mode)
    inputs = example_inputs(spec.inputs, device=device, mark_dynamic=False)
    t_built = time.time()

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(fn: Callable[..., Any]) -> None:
        result = fn(*inputs)
        if training:
            result.float().sum().backward()

    out: dict[str, Any] = {"kind": kind, "grad_mode": grad_mode.value}
    with torch.enable_grad() if training else torch.no_grad():
        if kind == "eager":
            fn = model
        elif kind in ("jit", "jit+megacache"):
            if kind == "jit+megacache":
                t0 = time.time()
                info = torch.compiler.load_cache_artifacts(Path(payload["megacache"]).read_bytes())
                out["megacache_load_s"] = time.time() - t0
                out["megacache_entries"] = str(info)[:200] if info is not None else None
            mode = payload.get("mode") or "default"
            fn = torch.compile(model, fullgraph=True, mode=mode)
        elif kind == "fleet":
            assert handle is not None
            t0 = time.time()
            fn = handle.bind(model)
            out["load_s"] = time.time() - t0
            out["source"] = getattr(fn, "source", None)
            out["reason"] = getattr(fn, "reason", None)
            out["timings"] = dict(handle.timings)
        elif kind == "farm":
            from farm.node.loader import load_artifact

            t0 = time.time()
            fn = load_artifact(payload["artifact"], payload["format"], module=model,
                               trust_unverified=True)  # built by this bench
            out["load_s"] = time.time() - t0
        else:
            raise ValueError(f"unknown scenario {kind!r}")
        t0 = time.time()
        step(fn)
        sync()
        t_first = time.time()
        out["first_call_s"] = t_first - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        ru_c = resource.getrusage(resource.RUSAGE_CHILDREN)  # g++ runs in children
        out["cpu_s"] = ru.ru_utime + ru.ru_stime + ru_c.ru_utime + ru_c.ru_stime
        n = int(payload.get("steady_calls", 20))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step(fn)
            sync()
            times.append(time.perf_counter() - t)
        out["steady_s"] = statistics.median(times) if times else None
    if kind == "jit" and payload.get("megacache_out"):
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(payload["megacache_out"]).write_bytes(saved[0])
    out.update(
        {
            # Absolute: a row under the agent counts from its client's start.
            "t_import_at": t_import,
            "t_first_at": t_first,
            "to_first_result_s": t_first - started,
            "import_s": t_import - started,
            "build_s": t_built - t_import,
            "compiled_files": _compiled_files(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
        }
    )
    if payload.get("check_no_compiler"):
        out["compilers_on_path"] = compilers_on_path(dict(os.environ))
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            out["inductor_compiler"] = get_cpp_compiler()
        except Exception as exc:
            out["inductor_compiler"] = f"none ({type(exc).__name__})"
    return out


def _compiled_files(cache: str | None) -> int:
    if not cache or not os.path.isdir(cache):
        return 0
    n = 0
    for _, _, files in os.walk(cache):
        n += sum(f.endswith((".so", ".cubin", ".o")) for f in files)
    return n


# --- the parent ---------------------------------------------------------------------


def run_child(payload: dict[str, Any], *, no_compiler: bool = False) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="coldstart-cache-")
    if payload.get("agent_socket"):
        try:
            return run_under_agent(payload, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    try:
        env = without_compilers() if no_compiler else dict(os.environ)
        extra = {
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": f"{cache}/triton",
            "CLIENT_CACHE_DIR": f"{cache}/farm-node-cache",
            "FARM_HOME": f"{cache}/farm",
        }
        if payload.get("farm_url"):
            extra["FARM_URL"] = payload["farm_url"]
        if payload.get("node_cache") == "prefetched":
            # ``farm prefetch`` at node provisioning: the resolve answer, trust
            # state and bytes are in this node's cache before the process starts
            # (not counted).
            prefetch_node_cache(payload, env, extra)
        if payload.get("isa_cache") == "cold":
            # The first process on a machine: farm.core.cpu_isa test-compiles the ISA.
            extra["FARM_ISA_CACHE"] = f"{cache}/cpu-isa.json"
        res = run_isolated(
            "bench.coldstart:scenario",
            {**payload, "check_no_compiler": no_compiler},
            timeout_s=TIMEOUT_S,
            memory_mb=MEMORY_MB,
            env=env,
            env_extra=extra,
            cwd=ROOT,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if res.ok:
        return dict(res.value)
    err = res.error or res.describe()
    return {"error": f"{res.error_type or 'failed'}: {err.splitlines()[0][:160]}"}


def prefetch_node_cache(payload: dict[str, Any], env: dict[str, str],
                        extra: dict[str, str]) -> None:
    """What ``farm prefetch`` does, in a process of its own with the row's
    environment, so the cached resolve answer is keyed as the row's own."""
    spec = JobSpec.from_json(payload["spec"])
    code = (
        "import sys; from farm.node.client import FarmClient; "
        "from farm.node.compiled import prefetch_compiled; "
        f"prefetch_compiled(model={payload['farm_model']!r}, ref='1', "
        f"example_inputs={[str(x) for x in spec.inputs]!r}, "
        f"grad_mode={payload.get('grad_mode') or 'inference'!r}, "
        f"device={payload['device'].split(':')[0]!r}, "
        f"client=FarmClient({payload['farm_url']!r}), formats={payload.get('farm_formats')!r}, "
        "overlap=False).result()"
    )
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    subprocess.run([sys.executable, "-c", code], env={**env, **extra, "PYTHONPATH": path},
                   cwd=ROOT, check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL)


def cache_env(cache: str) -> dict[str, str]:
    """A fresh node's caches: empty, per run (the agent reads these when used)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "CLIENT_CACHE_DIR": f"{cache}/farm-node-cache",
        "FARM_HOME": f"{cache}/farm",
    }


def agent_env() -> dict[str, str]:
    """The agent's and its clients' environment (the agent refuses a client whose
    import-time variables differ from its own)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def start_agent(sock: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """One agent for the whole run, started before the rounds."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "farm.node.agent", "--socket", str(sock)],
                            env=agent_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "listening at" not in line:
        proc.kill()
        raise SystemExit(f"the agent did not start: {line or proc.stderr.read()[-500:]}")
    ready = json.loads(line.split(": ", 2)[2])
    ready["wall_s"] = time.time() - t0
    # Its later log lines must not fill a pipe nobody reads.
    proc.stderr.close()
    return proc, ready


def run_under_agent(payload: dict[str, Any], cache: str) -> dict[str, Any]:
    """The scenario as ``farm run -- python bench/coldstart.py --child ...``:
    seconds from the client's process start (psutil, as the other rows)."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="coldstart-agent-") as tmp:
        pfile, ofile = Path(tmp) / "payload.json", Path(tmp) / "out.json"
        pfile.write_text(json.dumps(payload))
        cmd = [sys.executable, "-m", "farm.node.run", "--agent", payload["agent_socket"], "--",
               sys.executable, str(ROOT / "bench" / "coldstart.py"), "--child", str(pfile),
               str(ofile)]
        env = {**agent_env(), **cache_env(cache)}
        if payload.get("farm_url"):
            env["FARM_URL"] = payload["farm_url"]
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started = psutil.Process(proc.pid).create_time()
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"error": f"timed out after {TIMEOUT_S} s"}
        if "running the command directly" in err:
            # It ran, but not under the agent: not this row's number.
            return {"error": "not under the agent: " + err.strip().splitlines()[0][:160]}
        if proc.returncode != 0 or not ofile.exists():
            tail = err.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            return {"error": f"exit {proc.returncode}: {tail[0][:160]}"}
        out = json.loads(ofile.read_text())
    out["to_first_result_s"] = out["t_first_at"] - started
    out["import_s"] = out["t_import_at"] - started
    return dict(out)


def child_main(payload_file: str, out_file: str) -> int:
    """Under the agent (bench/coldstart.py --child PAYLOAD OUT): the scenario."""
    result = scenario(json.loads(Path(payload_file).read_text()))
    Path(out_file).write_text(json.dumps(result))
    return 0


def build(spec: JobSpec, device: str, out_dir: Path) -> dict[str, dict[str, Any]]:
    t0 = time.time()
    res = run_isolated(
        "farm.build.compile:compile_job",
        {"spec": spec.to_json(), "device": device, "out_dir": str(out_dir)},
        timeout_s=TIMEOUT_S,
        memory_mb=MEMORY_MB,
    )
    if not res.ok:
        raise SystemExit(f"compile failed: {res.describe()}\n{res.traceback or res.stderr_tail}")
    arts = {a["format"]: a for a in res.value["artifacts"]}
    print(
        f"compiled {spec.options.mode} in {time.time() - t0:.1f} s: "
        + ", ".join(
            f"{f} {a['meta']['size'] / 1e6:.2f} MB ({a['meta']['compile_s']:.1f} s)"
            for f, a in arts.items()
        ),
        flush=True,
    )
    return arts


def plan(args: argparse.Namespace, workdir: Path) -> list[tuple[str, dict[str, Any], bool]]:
    """(label, payload, no_compiler) for every way to a first result."""
    spec = job(args.model)
    base = {"spec": spec.to_json(), "device": args.device, "steady_calls": args.steady_calls}
    mega = workdir / "megacache.bin"
    rows: list[tuple[str, dict[str, Any], bool]] = [("eager", {**base, "kind": "eager"}, False)]
    if "jit" not in args.skip:
        rows.append(
            ("jit (cold cache, g++)", {**base, "kind": "jit", "megacache_out": str(mega)}, False)
        )
    if "megacache" not in args.skip and "jit" not in args.skip:
        rows.append(
            ("jit + megacache", {**base, "kind": "jit+megacache", "megacache": str(mega)}, False)
        )
    if args.farm_url:
        # Through a running farm (bench/gpu_farm.py built these models): the
        # whole fleet path, registry included.
        if args.device == "cuda" and not {"jit", "jit-autotune"} & set(args.skip):
            rows.append(
                (
                    "jit max-autotune-no-cudagraphs",
                    {**base, "kind": "jit", "mode": "max-autotune-no-cudagraphs"},
                    False,
                )
            )
        fleet = {**base, "kind": "fleet", "farm_url": args.farm_url}
        for name in args.farm_models:
            # The farm's defaults: the node names no format, the resolver picks.
            rows.append((f"farm fleet path: {name}", {**fleet, "farm_model": name}, False))
            if "prefetched" in args.node_cache:
                rows.append((f"farm fleet path: {name}, prefetched node cache",
                             {**fleet, "farm_model": name, "node_cache": "prefetched"}, False))
            for fmt in args.farm_formats or ():
                rows.append(
                    (
                        f"farm fleet path: {name} {fmt}",
                        {**fleet, "farm_model": name, "farm_formats": [fmt]},
                        False,
                    )
                )
                if args.device == "cpu" and fmt == "aoti":
                    rows.append(
                        (
                            f"farm fleet path: {name} {fmt}, first process on the machine",
                            {**fleet, "farm_model": name, "farm_formats": [fmt],
                             "isa_cache": "cold"},
                            False,
                        )
                    )
                if fmt == "aot_compile" and args.sequential_imports:
                    # The imports loading needs, after the model build rather
                    # than beside it: both contend for the GIL.
                    rows.append(
                        (
                            f"farm fleet path: {name} {fmt}, imports after build",
                            {**fleet, "farm_model": name, "farm_formats": [fmt],
                             "warm_imports": False},
                            False,
                        )
                    )
        if args.farm_train_models:
            train = {**base, "grad_mode": "training"}
            rows.append(("eager, training", {**train, "kind": "eager"}, False))
            for name in args.farm_train_models:
                rows.append(
                    (
                        f"farm fleet path: {name}, training",
                        {**train, "kind": "fleet", "farm_url": args.farm_url,
                         "farm_model": name},
                        False,
                    )
                )
                if "prefetched" in args.node_cache:
                    rows.append(
                        (
                            f"farm fleet path: {name}, training, prefetched node cache",
                            {**train, "kind": "fleet", "farm_url": args.farm_url,
                             "farm_model": name, "node_cache": "prefetched"},
                            False,
                        )
                    )
            if args.agent:
                # The same runs forked by the node agent (started in main).
                warm = {**train, "agent_socket": str(workdir / "agent.sock")}
                rows.append(("eager, training, under farm run", {**warm, "kind": "eager"},
                             False))
                for name in args.farm_train_models:
                    rows.append(
                        (
                            f"farm fleet path: {name}, training, under farm run",
                            {**warm, "kind": "fleet", "farm_url": args.farm_url,
                             "farm_model": name},
                            False,
                        )
                    )
    elif args.device == "cpu":
        arts = build(spec, "cpu", workdir / "default")
        rows += [
            (
                "farm aoti (cold, no compiler)",
                {**base, "kind": "farm", "format": "aoti", "artifact": arts["aoti"]["path"]},
                True,
            ),
            (
                "farm aot_compile (cold, g++)",
                {
                    **base,
                    "kind": "farm",
                    "format": "aot_compile",
                    "artifact": arts["aot_compile"]["path"],
                },
                False,
            ),
            (
                "farm aot_compile (cold, no compiler)",
                {
                    **base,
                    "kind": "farm",
                    "format": "aot_compile",
                    "artifact": arts["aot_compile"]["path"],
                },
                True,
            ),
        ]
    else:
        # Issue 7: the same scenarios on the GPU, plus max-autotune.
        arts = build(spec, args.device, workdir / "default")
        tuned = build(
            job(args.model, mode="max-autotune-no-cudagraphs"), args.device, workdir / "tuned"
        )
        rows += [
            (
                "jit max-autotune-no-cudagraphs",
                {**base, "kind": "jit", "mode": "max-autotune-no-cudagraphs"},
                False,
            ),
            (
                "farm aot_compile (cold)",
                {
                    **base,
                    "kind": "farm",
                    "format": "aot_compile",
                    "artifact": arts["aot_compile"]["path"],
                },
                False,
            ),
            (
                "farm aot_compile max-autotune (cold)",
                {
                    **base,
                    "kind": "farm",
                    "format": "aot_compile",
                    "artifact": tuned["aot_compile"]["path"],
                },
                False,
            ),
        ]
    return rows


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    def med(label: str, key: str) -> float | None:
        vals = [r[key] for r in results[label] if r.get(key) is not None and "error" not in r]
        return statistics.median(vals) if vals else None

    jit = med("jit (cold cache, g++)", "to_first_result_s") \
        if "jit (cold cache, g++)" in results else None
    eager = med("eager", "to_first_result_s")
    head = (
        f"{'path to the first result (fresh process)':<40} {'first s':>8} {'min s':>7} "
        f"{'x JIT':>6} {'x eager':>7} {'cpu s':>6} {'load s':>7} {'1st call s':>10} "
        f"{'steady ms':>9} {'import s':>8} {'build s':>7} {'after s':>9} {'extra':>6}  notes"
    )
    lines = [head, "-" * len(head)]
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"{label:<40} {'FAILED':>8}  {runs[0]['error'] if runs else ''}")
            continue
        first = med(label, "to_first_result_s")
        assert first is not None
        lo = min(r["to_first_result_s"] for r in ok)
        steady = med(label, "steady_s")
        load = med(label, "load_s")
        notes = []
        r0 = ok[0]
        if "compilers_on_path" in r0:
            notes.append(
                f"compilers on PATH: {r0['compilers_on_path'] or 'none'}; "
                f"inductor: {r0.get('inductor_compiler')}"
            )
        if r0.get("compiled_files"):
            notes.append(f"{r0['compiled_files']} compiled files in cache")
        if r0.get("source"):
            notes.append(
                f"served by {r0['source']}" + (f" ({r0['reason']})" if r0.get("reason") else "")
            )
        if r0.get("timings"):
            notes.append(
                "bg: "
                + ", ".join(
                    f"{k} {v:.2f}" for k, v in r0["timings"].items() if isinstance(v, (int, float))
                )
            )
        lines.append(
            f"{label:<40} {first:>8.2f} {lo:>7.2f} "
            f"{first / jit if jit else float('nan'):>6.2f} "
            f"{first / eager if eager else float('nan'):>7.2f} "
            f"{med(label, 'cpu_s') or 0:>6.1f} "
            f"{'-' if load is None else f'{load:.3f}':>7} "
            f"{med(label, 'first_call_s') or 0:>10.3f} "
            f"{'-' if steady is None else f'{steady * 1e3:.3f}':>9} "
            f"{med(label, 'import_s') or 0:>8.2f} {med(label, 'build_s') or 0:>7.2f} "
            f"{first - (med(label, 'import_s') or 0) - (med(label, 'build_s') or 0):>9.2f} "
            f"{extra_share(first, eager, jit):>6}"
            f"  {'; '.join(notes)}"
        )
    return "\n".join(lines + goals(results, med, eager, jit))


def extra_share(first: float, eager: float | None, jit: float | None) -> str:
    """The path's time beyond eager's, as a share of JIT's time beyond eager's."""
    if eager is None or jit is None or jit <= eager:
        return "-"
    return f"{(first - eager) / (jit - eager):.0%}"


def goals(
    results: dict[str, list[dict[str, Any]]],
    med: Callable[[str, str], float | None],
    eager: float | None,
    jit: float | None,
) -> list[str]:
    """Issue 15's goals, checked against this run's medians for each fleet path:
    inference at most 1.05x eager, training at most 1.3x eager training, steady
    per-call time within 5% of JIT's, a max-autotune artifact's first call no
    slower than a default one's."""
    fleet = [label for label in results if label.startswith("farm fleet path")]
    if not fleet or eager is None:
        return []
    jit_steady = med("jit (cold cache, g++)", "steady_s") \
        if "jit (cold cache, g++)" in results else None
    eager_train = med("eager, training", "to_first_result_s") if "eager, training" in results \
        else None
    default_first_call = {
        label.replace("default", ""): med(label, "first_call_s")
        for label in fleet if "default" in label
    }
    out = ["", "goals (issue 15), per fleet path (medians):"]
    for label in fleet:
        first = med(label, "to_first_result_s")
        if first is None:
            out.append(f"  {label}: FAILED")
            continue
        checks = []
        if ", training" in label:
            if eager_train:
                checks.append(f"{first / eager_train:.2f}x eager training (goal <= 1.3: "
                              f"{'met' if first <= 1.3 * eager_train else 'NOT met'})")
        else:
            checks.append(f"{first / eager:.2f}x eager (goal <= 1.05: "
                          f"{'met' if first <= 1.05 * eager else 'NOT met'})")
            if jit:
                checks.append(f"{first / jit:.0%} of JIT's first result")
            steady = med(label, "steady_s")
            if steady is not None and jit_steady:
                checks.append(f"steady {steady / jit_steady:.3f}x JIT's (goal within 5%: "
                              f"{'met' if steady <= 1.05 * jit_steady else 'NOT met'})")
        fc = med(label, "first_call_s")
        ref = default_first_call.get(label.replace("autotune", ""))
        if "autotune" in label and fc is not None and ref is not None:
            checks.append(
                f"first call {fc:.3f} s vs default's {ref:.3f} s "
                f"(goal: no slower: {'met' if fc <= max(ref * 1.1, ref + 0.005) else 'NOT met'})"
            )
        out.append(f"  {label}: " + "; ".join(checks))
    return out


def write_report(path: Path, args: argparse.Namespace, started: dt.datetime,
                 results: dict[str, list[dict[str, Any]]], rounds: int) -> str:
    text = "\n".join(
        [
            f"bench/coldstart.py --device {args.device} --model {args.model} "
            f"--repeats {args.repeats}{' --agent' if args.agent else ''}   "
            f"({started:%Y-%m-%d %H:%M}); rounds run: {rounds}",
            f"model: {MODELS[args.model][0]} {json.dumps(MODELS[args.model][1])} "
            f"input {MODELS[args.model][2]}",
            f"machine: {machine()}",
            "first s: median seconds from process start (interpreter, import torch, model build "
            "included) to the first result (training: forward and backward); min s: fastest "
            "round; cpu s: CPU seconds of the process and its children (g++) to the first "
            "result; import s: interpreter start and import torch; build s: the model with its "
            "weights (the fleet path's farm work runs in the background meanwhile); after s: "
            "first s less both, the part that differs between paths",
            *agent_note(args),
            "",
            table(results),
            "",
        ]
    )
    path.write_text(text)
    return text


def agent_note(args: argparse.Namespace) -> list[str]:
    ready = getattr(args, "agent_ready", None)
    if not ready:
        return []
    return [
        f"node agent (farm agent, started once before the rounds, not counted in any row): "
        f"ready {ready['wall_s']:.2f} s after its start, imports {ready['preload_s']:.2f} s, "
        f"{ready['threads']} Python thread, {ready['native_threads']} native, CUDA initialized: "
        f"{ready['cuda_initialized']}; rows 'under farm run' count from the farm run client's "
        "process start, their import s is the client's start, connect and fork (torch is "
        "imported already), cpu s the forked child's only",
    ]


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    return (
        f"torch {torch.__version__}, python {platform.python_version()}, {cpu}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, {gpu}, "
        f"load average {', '.join(f'{x:.1f}' for x in load)}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="transformer", choices=sorted(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steady-calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--farm-url", help="measure the fleet path against this farm")
    ap.add_argument(
        "--farm-models",
        nargs="*",
        default=["bench-default", "bench-autotune"],
        help="model names (version 1) the farm serves for --model",
    )
    ap.add_argument(
        "--farm-formats",
        nargs="*",
        default=None,
        help="also one fleet-path row per model and format (the default row names none: "
        "the farm's resolver picks)",
    )
    ap.add_argument(
        "--farm-train-models",
        nargs="*",
        default=[],
        help="training model names (version 1) the farm serves for --model: an "
        "'eager, training' row and a fleet row each (first result: forward + backward)",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=("jit", "megacache", "jit-autotune"),
        help="leave out these JIT rows (jit: all of them; the x JIT column is then empty)",
    )
    ap.add_argument(
        "--node-cache",
        nargs="*",
        default=["empty", "prefetched"],
        choices=("empty", "prefetched"),
        help="the node cache states of the fleet rows: empty (every row) and prefetched "
        "(`farm prefetch` ran before the process started: also a row per fleet model)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop before a round that would not end within this many seconds of the start "
        "(judged by the slowest round so far); the table covers the rounds that ran",
    )
    ap.add_argument(
        "--sequential-imports",
        action="store_true",
        help="also an aot_compile fleet row that imports after the model build",
    )
    ap.add_argument(
        "--agent",
        action="store_true",
        help="also the training rows under `farm run`, in forks of a node agent started once "
        "before the rounds (needs --farm-train-models)",
    )
    args = ap.parse_args(argv)
    if args.agent and not args.farm_train_models:
        ap.error("--agent adds training rows: give --farm-train-models (and --farm-url)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda needs a GPU (issue 7 runs it on the H200)")
    started = dt.datetime.now()
    print(
        f"coldstart: {args.model} {MODELS[args.model][2]} on {args.device}; {machine()}", flush=True
    )
    if args.farm_url and args.device == "cpu":
        # Fleet rows other than the "first process" one run as later processes
        # of a node: the per-machine CPU ISA cache (farm.core.cpu_isa) is filled.
        from farm.core.target import detect_local_target

        detect_local_target("cpu")
    t_start = time.monotonic()
    path = args.out / f"coldstart-{args.device}-{started:%Y%m%d-%H%M%S}.txt"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coldstart-") as tmp:
        rows = plan(args, Path(tmp))
        agent = None
        if args.agent:
            agent, args.agent_ready = start_agent(Path(tmp) / "agent.sock")
            print(f"  agent started in {args.agent_ready['wall_s']:.2f} s: "
                  f"{json.dumps(args.agent_ready)}", flush=True)
        results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in rows}
        slowest = 0.0
        done = 0
        for rnd in range(args.repeats):
            left = None if args.budget_s is None else args.budget_s - (time.monotonic() - t_start)
            if left is not None and rnd > 0 and slowest * 1.1 > left:
                print(f"  stopping after {done} round(s): the next (~{slowest:.0f} s) would "
                      f"not end within the budget ({left:.0f} s left)", flush=True)
                break
            t_round = time.monotonic()
            for label, payload, no_cc in rows:
                if payload["kind"] == "jit+megacache" and not Path(payload["megacache"]).exists():
                    results[label].append({"error": "no megacache bytes (the jit run saved none)"})
                    continue
                r = run_child(payload, no_compiler=no_cc)
                results[label].append(r)
                shown = r.get("error") or f"{r['to_first_result_s']:.2f} s"
                print(f"  round {rnd + 1}: {label}: {shown}", flush=True)
            slowest = max(slowest, time.monotonic() - t_round)
            done = rnd + 1
            # After every round: a run stopped from outside keeps what it measured.
            write_report(path, args, started, results, done)
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
    text = write_report(path, args, started, results, done)
    print("\n" + text)
    print(f"written to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
