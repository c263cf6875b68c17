"""The `farm` subcommands: each takes the parsed arguments and returns an exit status."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
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
    _print_json,
)
from farm.core.specs import (
    CompileOptions,
    GradMode,
    JobSpec,
    ModelRef,
    SpecError,
)
from farm.core.target import Target


def _client(args: argparse.Namespace) -> Any:
    from farm.node.client import FarmClient

    return FarmClient(url=args.url)


def _resolve_target(text: str) -> Target:
    from farm.core.target import detect_local_target

    if text.startswith("auto"):
        device = text.partition(":")[2] or None
        return detect_local_target(device, check_compiler=False)
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

    if args.workers > 1:
        uvicorn.run("registry.api.app:create_app", factory=True, host=args.host,
                    port=args.port, workers=args.workers)
    else:
        from registry.api.app import create_app

        uvicorn.run(create_app(), host=args.host, port=args.port)
    return EXIT_OK


def cmd_submit(args: argparse.Namespace) -> int:
    from farm.core.codepack import CodePackError, plan_source

    try:
        # Never imports the module: its file or package is found on disk.
        plan = plan_source(args.entrypoint, source=getattr(args, "source", None))
    except CodePackError as exc:
        raise UsageError(str(exc)) from None
    try:
        spec = JobSpec(
            name=args.name,
            version=args.version,
            model=ModelRef(entrypoint=plan.entrypoint, kwargs=args.kwargs,
                           kind="function" if args.function else "factory"),
            inputs=tuple(args.inputs),
            grad_mode=GradMode.TRAINING if args.train else GradMode.INFERENCE,
            options=CompileOptions(mode=args.mode),
            targets=tuple(args.targets),
        )
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    client = _client(args)
    try:
        job = client.submit(spec, source=plan.source if plan.source is not None else False)
    except CodePackError as exc:
        raise UsageError(str(exc)) from None
    code = job.get("code")
    if code and not args.json:
        print(f"code: {code['source']} ({code['files']} files, {_human_size(code['size'])}, "
              f"sha256 {code['digest'][:12]}, "
              f"{'uploaded' if code['uploaded'] else 'already on the farm'})", file=sys.stderr)
    if not args.wait:
        if args.json:
            _print_json(job)
        else:
            print(job.get("id"))
            if job.get("warning"):
                print(f"farm: warning: {job['warning']}", file=sys.stderr)
        return EXIT_OK
    progress = Progress()
    try:
        view = client.wait(job["id"], args.timeout, on_progress=progress)
    finally:
        progress.finish()
    if args.json:
        _print_json(view)
    else:
        print("\n".join(_job_lines(view)))
    if view.get("state") != "succeeded":
        failed = [b for b in view.get("builds") or [] if b.get("state") not in
                  ("succeeded", "reused")]
        why = _first_line(view.get("error") or next(
            (b.get("error") for b in failed if b.get("error")), "") or "")
        raise CommandFailed(f"job {view.get('id')} {view.get('state')}"
                            + (f": {why}" if why else ""))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    view = _client(args).job(args.job_id)
    if args.json:
        _print_json(view)
    else:
        print("\n".join(_job_lines(view, with_log=args.log)))
    return EXIT_OK


def _resolve(args: argparse.Namespace, client: Any) -> dict[str, Any]:
    from farm.node.errors import NotFoundError, format_rejections

    name, ref = args.model
    target = _resolve_target(args.target)
    mode = GradMode.TRAINING if args.train else GradMode.INFERENCE
    try:
        return dict(client.resolve(name, ref, args.inputs, mode, target, formats=args.formats))
    except NotFoundError as exc:
        if args.json:
            _print_json(exc.detail if isinstance(exc.detail, dict) else {"detail": str(exc)})
        elif exc.rejections:
            print(f"nothing for {target} fits; each candidate and why:")
            print(format_rejections(exc.rejections, limit=50))
        raise CommandFailed(str(exc)) from None


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
    if resolved.get("alternatives"):
        lines.append(f"  + {len(resolved['alternatives'])} other loadable artifact(s)")
    return lines


def cmd_resolve(args: argparse.Namespace) -> int:
    resolved = _resolve(args, _client(args))
    if args.json:
        _print_json(resolved)
    else:
        print("\n".join(_artifact_lines(resolved)))
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    client = _client(args)
    resolved = _resolve(args, client)
    cached = client.fetch(resolved)  # verified: digest and signature
    out: Path = args.output
    if out.is_dir():
        raise UsageError(f"-o {out}: is a directory; give a file name")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(cached, tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    a = resolved["artifact"]
    if args.json:
        _print_json({**resolved, "path": str(out)})
    else:
        print(f"{out}  sha256:{a['digest']}  {a.get('format')}  {_human_size(a.get('size'))}")
    return EXIT_OK


def cmd_prefetch(args: argparse.Namespace) -> int:
    client = _client(args)
    resolved = _resolve(args, client)
    started = time.monotonic()
    path = client.fetch(resolved)
    a = resolved["artifact"]
    if args.json:
        _print_json({**resolved, "path": str(path)})
    else:
        print(f"cached {resolved.get('model')}@{resolved.get('version')} sha256:{a['digest'][:12]} "
              f"({a.get('format')}, {_human_size(a.get('size'))}) at {path} in "
              f"{time.monotonic() - started:.1f} s")
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    models = _client(args).models()
    if args.json:
        _print_json(models)
        return EXIT_OK
    if not models:
        print("no models")
    for m in models:
        aliases = m.get("aliases") or {}
        alias_text = ", ".join(f"{k}->{v}" for k, v in sorted(aliases.items())) \
            if isinstance(aliases, dict) else ", ".join(map(str, aliases))
        print(f"{m.get('name')}" + (f"  ({alias_text})" if alias_text else ""))
        for v in m.get("versions") or []:
            print(f"  {v.get('version')}  {v.get('entrypoint')}  "
                  f"{v.get('artifacts', 0)} artifact(s)")
    return EXIT_OK


def cmd_targets(args: argparse.Namespace) -> int:
    body = _client(args).targets()
    if args.json:
        _print_json(body)
        return EXIT_OK
    items = body.get("targets", body) if isinstance(body, dict) else body
    if not items:
        print("no live compile workers")
    for t in items or []:
        if isinstance(t, dict):
            extra = {k: v for k, v in t.items() if k != "target"}
            print(f"{t.get('target')}" + (f"  {json.dumps(extra, default=str)}" if extra else ""))
        else:
            print(t)
    return EXIT_OK


def cmd_alias_set(args: argparse.Namespace) -> int:
    body = _client(args).set_alias(args.name, args.alias, args.version)
    if args.json:
        _print_json(body)
    else:
        print(f"{args.name}@{args.alias} -> {args.version}")
    return EXIT_OK


def cmd_token_create(args: argparse.Namespace) -> int:
    if args.db:
        from farm.core.settings import get_settings
        from registry.auth import create_token
        from registry.db import Database

        db = Database(get_settings().resolved_database_url(), check=True)
        try:
            token = create_token(db, args.name, args.role)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        finally:
            db.dispose()
    else:
        token = str(_client(args).create_token(args.name, args.role)["token"])
    if args.json:
        _print_json({"name": args.name, "role": args.role, "token": token})
    else:
        print(token)
        print(f"farm: {args.role} token {args.name!r} created; it is shown only this once",
              file=sys.stderr)
    return EXIT_OK


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
