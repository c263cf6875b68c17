"""The `farm` subcommands: each takes the parsed arguments and returns an exit status.

Beside them: ``admin_commands`` (aliases, deletions, tokens, the cache salt),
``trust_commands`` (keys, verify), ``fleet_commands``, ``agent_commands``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from farm.app.console import (
    EXIT_OK,
    CommandFailed,
    Progress,
    UsageError,
    _first_line,
    _human_size,
    _job_lines,
    _json_text,
    _print_json,
    _short_target,
    answer,
    concise_error,
    stages,
)
from farm.app.subcommands import farm_client
from farm.core.specs import (
    CompileOptions,
    GradMode,
    JobSpec,
    ModelRef,
    SpecError,
    TrainSpec,
)
from farm.core.target import Target


def _resolve_target(text: str) -> Target:
    if text.startswith("auto"):
        from farm.node.local_target import node_target

        # Kept per machine: no torch import (1-7 s) on every call.
        return node_target(text.partition(":")[2] or None)
    return Target.parse(text)


def start_embedded(settings: Any, *, host: str, port: int) -> None:
    """``farm serve --embedded``: the API with workers beside it (farm.app.embedded)."""
    try:
        from farm.app.embedded import run_embedded
    except ImportError as exc:
        raise CommandFailed(f"the embedded farm is not available: {exc}") from None
    run_embedded(host, port)


def cmd_serve(args: argparse.Namespace) -> int:
    from farm.core.settings import get_settings

    if args.embedded:
        start_embedded(get_settings(), host=args.host, port=args.port)
        return EXIT_OK
    import uvicorn

    settings = get_settings()
    cert = args.ssl_certfile or settings.farm_tls_cert or None
    key = args.ssl_keyfile or settings.farm_tls_key or None
    if bool(cert) != bool(key):
        raise UsageError("TLS needs both a certificate and its key (--ssl-certfile and "
                         "--ssl-keyfile, or FARM_TLS_CERT and FARM_TLS_KEY)")
    tls: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key} if cert else {}
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"{'https' if cert else 'http'}://{shown}:{args.port}"
    print(f"torch-farm API on {url}\n  export FARM_URL={url}", flush=True)
    if args.workers > 1:
        uvicorn.run("registry.api.app:create_app", factory=True, host=args.host,
                    port=args.port, workers=args.workers, **tls)
    else:
        from registry.api.app import create_app

        uvicorn.run(create_app(), host=args.host, port=args.port, **tls)
    return EXIT_OK


def cmd_submit(args: argparse.Namespace) -> int:
    from farm.core.codepack import CodePackError, plan_source

    try:
        # Never imports the module: its file or package is found on disk.
        plan = plan_source(args.entrypoint, source=getattr(args, "source", None))
    except CodePackError as exc:
        raise UsageError(str(exc)) from None
    try:
        # --loss makes it a training step: the factory's module with its loss
        # (and backward) compiled, trained with --optimizer on the node.
        train = None if not getattr(args, "loss", None) else TrainSpec(
            loss=args.loss, targets=args.loss_targets, optimizer=args.optimizer,
            optimizer_kwargs=args.optimizer_kwargs)
        if train is not None and args.function:
            raise SpecError("--loss trains a factory's module; a --function job has none")
        kind = "training_step" if train else "function" if args.function else "factory"
        spec = JobSpec(
            name=args.name,
            version=args.version,
            model=ModelRef(entrypoint=plan.entrypoint, kwargs=args.kwargs, kind=kind,
                           external_data=tuple(args.external_data), train=train),
            inputs=tuple(args.inputs),
            grad_mode=(GradMode.TRAINING if args.train or train is not None
                       else GradMode.INFERENCE),
            options=CompileOptions(mode=args.mode, backend=args.backend,
                                   guard_filter=args.guard_filter,
                                   disable_guard_check=args.disable_guard_check,
                                   regional=args.regional,
                                   per_block=getattr(args, "per_block", False),
                                   weights=args.weights),
            targets=tuple(str(_resolve_target(t)) if t.startswith("auto") else t
                          for t in args.targets),
            project=getattr(args, "project", None),
        )
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    client = farm_client(args)
    wheels = list(getattr(args, "wheels", None) or [])
    requirements = getattr(args, "requirements", None)
    from farm.core.wheels import WheelError, check_wheel, parse_pinned

    try:
        # Before anything reaches the farm: a refused wheel or an unpinned
        # line is the user's to fix, named here (the pack checks again).
        for w in wheels:
            check_wheel(w)
        if requirements is not None:
            try:
                text = Path(requirements).read_text()
            except OSError as exc:
                raise UsageError(f"--requirements {requirements}: {exc.strerror}") from None
            parse_pinned(text, source=str(requirements))
    except WheelError as exc:
        raise UsageError(str(exc)) from None
    source = plan.source
    if (source is not None and getattr(args, "source", None) is None and wheels
            and plan.entrypoint == args.entrypoint):
        from farm.core.wheels import top_levels_of

        # The module is one a --wheel provides: the wheel is the code, not
        # a source tree that happens to lie in the current directory.
        top = plan.entrypoint.partition(":")[0].split(".")[0]
        if any(top in top_levels_of(w) for w in wheels):
            source = None
    from farm.app.entrypoint_check import missing_factory

    # A typo'd factory is told here, in a second, before anything is uploaded
    # (in the code that ships: not a same-named tree when a wheel is the code).
    if (why := missing_factory(source, plan.entrypoint, args.entrypoint)) is not None:
        raise UsageError(why)
    extra: dict[str, Any] = {}
    if wheels:
        extra["wheels"] = wheels
    if requirements is not None:
        extra["requirements"] = requirements
    if getattr(args, "rebuild", False):
        extra["rebuild"] = True
    try:
        job = client.submit(spec, source=source if source is not None else False, **extra)
    except CodePackError as exc:
        raise UsageError(str(exc)) from None
    code = job.get("code")
    if code and not args.json:
        print(code_line(code), file=sys.stderr)
    if not args.wait:
        if args.json:
            _print_json(job)
        else:
            print(job.get("id"))
            if job.get("warning"):
                print(f"farm: warning: {job['warning']}", file=sys.stderr)
        return EXIT_OK
    view = _watch(client, str(job["id"]), args.timeout)
    answer(args, view, _job_lines)
    if view.get("state") != "succeeded":
        # On stderr, for whoever reads only that: the same short line as above.
        failed = [b for b in view.get("builds") or [] if b.get("state") not in
                  ("succeeded", "reused")]
        why = concise_error(view.get("error") or next(
            (b.get("error") for b in failed if b.get("error")), "") or "")
        if why and not args.json and _same_terminal():
            # Both streams on one screen: the reason is already there, once.
            why = "its error is above"
        raise CommandFailed(f"job {view.get('id')} {view.get('state')}"
                            + (f": {why}" if why else ""))
    return EXIT_OK


WATCH_HEARTBEAT_S = 30.0


def _same_terminal() -> bool:
    """stdout and stderr are the same terminal (what a person sees once)."""
    try:
        return (sys.stdout.isatty() and sys.stderr.isatty()
                and os.ttyname(sys.stdout.fileno()) == os.ttyname(sys.stderr.fileno()))
    except (OSError, ValueError):
        return False


def _watch(client: Any, job_id: str, timeout: float | None) -> dict[str, Any]:
    """Wait for a job with progress on stderr. Ctrl-C or ``--timeout`` stop the
    watching, not the job: both say so and how to watch it again."""
    from farm.node.errors import JobTimeout

    again = f"`farm status {job_id} --wait` watches it again"
    progress = Progress()
    started = last_change = time.monotonic()
    last: list[tuple[str, str]] = []

    def on_progress(view: dict[str, Any]) -> None:
        # Piped, a compile says nothing for minutes between stage changes: a
        # line every HEARTBEAT_S says the watch (and the build) is alive.
        nonlocal last, last_change
        progress(view)
        now, current = time.monotonic(), stages(view)
        if current != last:
            last, last_change = current, now
        elif not progress.tty and now - last_change >= WATCH_HEARTBEAT_S:
            last_change = now
            busy = [f"{what}: {stage}" for what, stage in current[1:]
                    if stage not in ("succeeded", "failed", "reused")] or [
                        f"{what}: {stage}" for what, stage in current[:1]]
            print(f"{'; '.join(busy)}  still, {now - started:.0f}s", file=sys.stderr,
                  flush=True)

    try:
        return dict(client.wait(job_id, timeout, on_progress=on_progress))
    except KeyboardInterrupt:
        progress.finish()
        print(f"\nfarm: stopped watching; job {job_id} goes on on the farm; {again}",
              file=sys.stderr)
        raise SystemExit(130) from None
    except JobTimeout as exc:
        state = exc.detail.get("state") if isinstance(exc.detail, dict) else "running"
        raise CommandFailed(f"job {job_id} still {state} after {timeout:g} s; it goes on on "
                            f"the farm: {again}") from None
    finally:
        progress.finish()


def code_line(code: dict[str, Any]) -> str:
    """``farm submit``'s line about the code it shipped: files and their bytes
    (the pack itself, a tar, is larger: headers and padding)."""
    n = int(code.get("files") or 0)
    size = code.get("source_bytes")
    what = f"{n} file{'' if n == 1 else 's'}"
    if size is not None:
        what += f", {_human_size(int(size))}"
    what += f"; pack {_human_size(code.get('size'))}"
    return (f"code: {code['source']} ({what}, sha256 {str(code['digest'])[:12]}, "
            f"{'uploaded' if code.get('uploaded') else 'already on the farm'})")


def cmd_status(args: argparse.Namespace) -> int:
    from farm.app.fleet_commands import model_status
    from farm.node.errors import NotFoundError

    if not re.fullmatch(r"[0-9a-f-]+", args.job_id):
        return model_status(args, args.job_id)  # not a job id: a model's name
    client = farm_client(args)
    try:
        view = client.job(args.job_id)
    except NotFoundError:
        return model_status(args, args.job_id)  # a hex-looking model name
    if args.wait and view.get("state") not in ("succeeded", "failed", "partial"):
        view = _watch(client, str(view["id"]), args.timeout)
    answer(args, view, lambda v: _job_lines(v, with_log=args.log))
    state = view.get("state")
    if state in ("failed", "partial"):
        # A script that checks `farm status` must see a failed job fail.
        raise CommandFailed(f"job {view.get('id')} {state}")
    return EXIT_OK


def _jobs_lines(jobs: list[dict[str, Any]], *, state: str | None,
                model: str | None) -> Iterator[str]:
    if not jobs:
        yield ("no jobs" + (f" in state {state}" if state else "")
               + (f" of {model}" if model else ""))
    for j in jobs:
        builds = ", ".join(
            f"{_short_target(str(b.get('target')))}: {b.get('stage') or b.get('state')}"
            for b in j.get("builds") or [])
        when = str(j.get("created_at") or "")[:19].replace("T", " ")
        yield (f"{j['id']}  {when}  {j.get('model')}@{j.get('version')}  {j.get('state')}"
               + (f"  [{builds}]" if builds else ""))
        if j.get("error"):
            yield f"    error: {_first_line(j['error'])}"


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs = farm_client(args).jobs(state=args.state, model=args.model, limit=args.limit)
    return answer(args, jobs, lambda js: _jobs_lines(js, state=args.state, model=args.model))


def _resolve(args: argparse.Namespace, client: Any) -> dict[str, Any]:
    from farm.node.errors import NotFoundError, format_rejections

    name, ref = args.model
    target = _resolve_target(args.target)
    mode = GradMode.TRAINING if args.train else GradMode.INFERENCE
    try:
        return dict(client.resolve(name, ref, args.inputs, mode, target, formats=args.formats,
                                   options=getattr(args, "options", None)))
    except NotFoundError as exc:
        if args.json:
            _print_json(exc.detail if isinstance(exc.detail, dict) else {"detail": str(exc)})
        elif exc.rejections:
            print(f"nothing for {target} fits; each candidate and why:")
            print(format_rejections(exc.rejections, limit=50))
        raise CommandFailed(str(exc)) from None


LOAD_HINT = """\
load it on a node with the same target (its module supplies the weights; the
attestation beside the file is checked first against the farm's root public key,
FARM_ROOT_KEY: an embedded farm's is FARM_HOME/root-key.pem.pub):
  from farm.node.loader import load_artifact
  fn = load_artifact("{path}", "{format}", module=model)   # model: your nn.Module, eval()
  with torch.no_grad():                                    # {grad_mode} artifact
      y = fn(x)"""


def _artifact_lines(resolved: dict[str, Any]) -> list[str]:
    a = resolved["artifact"]
    lines = [
        f"{resolved.get('model', '')}@{resolved.get('version', '')}",
        f"  digest    sha256:{a['digest']}",
        f"  format    {a.get('format')}  {_human_size(a.get('size'))}",
        f"  target    {a.get('target')}",
        f"  inputs    {', '.join(a.get('inputs') or [])}  ({a.get('grad_mode')})",
    ]
    if a.get("first_call_compiles"):
        lines.append("  warning   its first call still compiles")
    if resolved.get("offline"):
        lines.append("  offline   the farm did not answer; the answer kept at "
                     f"{resolved.get('resolved_at')}")
    for i, why in enumerate(resolved.get("why") or []):
        lines.append(f"  {'why' if i == 0 else '':<9} {why}")
    if resolved.get("alternatives"):
        lines.append(f"  + {len(resolved['alternatives'])} other loadable artifact(s)")
    return lines


def cmd_resolve(args: argparse.Namespace) -> int:
    return answer(args, _resolve(args, farm_client(args)), _artifact_lines)


def cmd_fetch(args: argparse.Namespace) -> int:
    out: Path = args.output
    if out.is_dir():
        raise UsageError(f"-o {out}: is a directory; give a file name")
    if out.exists() and not args.force:
        raise UsageError(f"-o {out}: the file exists; pass --force to overwrite it")
    client = farm_client(args)
    resolved = _resolve(args, client)
    # Verified: the attestations against this request, then the digest.
    cached, verified = client.fetch_verified(resolved)
    from farm.node.verify import bundle_path

    a = resolved["artifact"]
    plain = getattr(args, "plain", False)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if plain:
            tmp.write_bytes(_plain_bytes(Path(cached), str(a.get("format"))))
        else:
            shutil.copyfile(cached, tmp)
        if verified is not None and not plain:
            # Beside the file: what another node checks it with (farm verify FILE).
            bundle = bundle_path(out)
            btmp = bundle.with_name(f".{bundle.name}.{os.getpid()}.tmp")
            btmp.write_text(_json_text(client.bundle(resolved, verified)))
            os.replace(btmp, bundle)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if args.json:
        _print_json({**resolved, "path": str(out), "plain": plain})
    elif plain:
        print(f"{out}  torch's own {a.get('format')} file of sha256:{a['digest']}  "
              f"{_human_size(out.stat().st_size)}")
        print(PLAIN_HINT[str(a.get("format"))].format(path=out), file=sys.stderr)
    else:
        print(f"{out}  sha256:{a['digest']}  {a.get('format')}  {_human_size(a.get('size'))}"
              "  (the farm's file, with its attestation beside it)")
        print(LOAD_HINT.format(path=out, format=a.get("format"), grad_mode=a.get("grad_mode")),
              file=sys.stderr)
    return EXIT_OK


# What opens a --plain file, and what it lacks next to the farm's.
PLAIN_HINT = {
    "aot_compile": """\
open it with torch alone (it was checked before it was written; nothing beside it
checks it again, and a CPU build's kernels are compiled again at its first load):
  with open("{path}", "rb") as f:
      fn = torch.compiler.load_compiled_function(f)
  y = fn(model, x)                      # model: your nn.Module, eval(), under no_grad""",
    "aoti": """\
open it with torch alone (it was checked before it was written):
  runner = torch._inductor.aoti_load_package("{path}")
  y = runner(x)""",
}


def _plain_bytes(cached: Path, fmt: str) -> bytes:
    """torch's own bytes of a verified artifact: an aot_compile bundle's
    ``save_compiled_function`` entry (farm.node.bundle), anything else as is."""
    from farm.node.bundle import is_bundle, read_bundle

    if fmt == "aot_compile" and is_bundle(cached):
        return read_bundle(cached)[0]
    return cached.read_bytes()


def cmd_prefetch(args: argparse.Namespace) -> int:
    client = farm_client(args)
    resolved = _resolve(args, client)
    started = time.monotonic()
    path = client.fetch(resolved)
    a = resolved["artifact"]
    return answer(args, {**resolved, "path": str(path)}, lambda r: [
        f"cached {r.get('model')}@{r.get('version')} sha256:{a['digest'][:12]} "
        f"({a.get('format')}, {_human_size(a.get('size'))}) at {path} in "
        f"{time.monotonic() - started:.1f} s"])


def _models_lines(models: list[dict[str, Any]]) -> Iterator[str]:
    if not models:
        yield "no models"
    for m in models:
        aliases = m.get("aliases") or {}
        alias_text = ", ".join(f"{k}->{v}" for k, v in sorted(aliases.items())) \
            if isinstance(aliases, dict) else ", ".join(map(str, aliases))
        project = f"  [project {m['project']}]" if m.get("project") else ""
        yield f"{m.get('name')}" + (f"  ({alias_text})" if alias_text else "") + project
        for v in m.get("versions") or []:
            # kwargs shown: two versions of one entrypoint may differ by them alone.
            kwargs = json.dumps(v.get("kwargs") or {}, sort_keys=True, separators=(",", ":"))
            by = f"  by {v['submitted_by']}" if v.get("submitted_by") else ""
            yield (f"  {v.get('version')}  {v.get('entrypoint')}  {kwargs}  "
                   f"{v.get('artifacts', 0)} artifact(s){by}")


def cmd_models(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).models(), _models_lines)


def _targets_lines(body: Any) -> Iterator[str]:
    items = body.get("targets", body) if isinstance(body, dict) else body
    if not items:
        yield "no live compile workers"
    for t in items or []:
        if isinstance(t, dict):
            extra = {k: v for k, v in t.items() if k != "target"}
            yield f"{t.get('target')}" + (f"  {json.dumps(extra, default=str)}" if extra else "")
        else:
            yield str(t)


def cmd_targets(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).targets(), _targets_lines)


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import run_worker

    if args.device and args.kind != "compile":
        raise UsageError("--device applies to compile workers only")
    run_worker(args.kind, device=args.device, concurrency=args.concurrency,
               loglevel=args.loglevel)
    return EXIT_OK


def cmd_db(args: argparse.Namespace) -> int:
    from farm.core.settings import get_settings
    from registry import db

    url = get_settings().resolved_database_url()
    if args.db_command == "upgrade":
        db.upgrade(url, args.revision)
        print(f"database at revision {db.current_revision(url)}")
    elif args.db_command == "downgrade":
        db.downgrade(url, args.revision)
        print(f"database at revision {db.current_revision(url) or 'base (empty)'}")
    else:
        current = db.current_revision(url)
        head = db.head_revision()
        state = "up to date" if current == head else f"head is {head}: run 'farm db upgrade'"
        print(f"{current or 'base (empty)'}  ({state})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    try:
        demo = importlib.import_module("farm.app.demo")
    except ImportError as exc:
        raise CommandFailed(f"the demo is not available: {exc}") from None
    result = demo.main(list(args.demo_args))
    return int(result or 0)
