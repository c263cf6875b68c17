"""`farm`: the command line, over the same HTTP API as the fleet client.

``FARM_URL`` and ``FARM_TOKEN`` come from the environment. Output for people
goes to stdout, progress of long waits to stderr, and ``--json`` prints one
JSON document on stdout for scripts. An error is one line on stderr,
``farm: error: ...``, with exit status 2 for a usage error (a bad argument, a
malformed input spec or JSON) and 1 for a failure (the farm said no, a job
failed, the farm cannot be reached).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from farm.core.specs import (
    COMPILE_MODES,
    CompileOptions,
    GradMode,
    JobSpec,
    ModelRef,
    SpecError,
    TensorSpec,
)
from farm.core.target import Target, TargetError, TargetSelector

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


class CommandFailed(Exception):
    """The command ran and did not succeed (exit 1); the message is the one line."""


# --- argument types -------------------------------------------------------------


def parse_model_ref(text: str) -> tuple[str, str | None]:
    """``NAME``, ``NAME@VERSION`` or ``NAME@ALIAS`` -> (name, ref or None)."""
    name, sep, ref = text.partition("@")
    if not _NAME_RE.match(name):
        raise argparse.ArgumentTypeError(
            f"bad model {text!r}: expected NAME[@VERSION|@ALIAS], the name of letters, digits, "
            "'.', '_' and '-'")
    if sep and not _REF_RE.match(ref):
        raise argparse.ArgumentTypeError(
            f"bad model {text!r}: the version or alias after '@' is "
            f"{'empty' if not ref else 'malformed'}")
    return name, (ref if sep else None)


def input_spec(text: str) -> TensorSpec:
    try:
        return TensorSpec.parse(text)
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object like '{{\"d\": 64}}', got {type(value).__name__}")
    return value


def target_selector(text: str) -> str:
    try:
        return str(TargetSelector.parse(text))
    except TargetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def node_target(text: str) -> str:
    """``auto`` (this machine) or a full target."""
    if text in ("auto", "auto:cpu", "auto:cuda"):
        return text
    try:
        return str(Target.parse(text))
    except TargetError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'auto', 'auto:cpu', 'auto:cuda')") from None


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


# --- the parser ---------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        sys.stderr.write(f"farm: error: {message}{hint}\n")
        raise SystemExit(EXIT_USAGE)


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_resolve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="NAME[@VERSION|@ALIAS]", type=parse_model_ref,
                   help="model name; default ref: the 'latest' alias, else the newest version")
    p.add_argument("--input", "-i", dest="inputs", metavar="SPEC", type=input_spec,
                   action="append", required=True,
                   help="input spec, once per positional input, e.g. float32[8,64]")
    p.add_argument("--target", type=node_target, default="auto", metavar="T|auto",
                   help="the node's full target; 'auto' (default) detects this machine "
                        "('auto:cpu', 'auto:cuda' pick the device)")
    p.add_argument("--train", action="store_true",
                   help="an artifact for training (grad enabled); default: inference")
    p.add_argument("--format", dest="formats", action="append", metavar="FORMAT",
                   help="only artifacts of this format (aot_compile, aoti); repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="farm", description="torch-farm: a build farm and artifact registry "
                     "for ahead-of-time compiled PyTorch programs.",
                     epilog="FARM_URL and FARM_TOKEN come from the environment.")
    parser.add_argument("--url", help="the farm's API (default: $FARM_URL)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (repeat for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("serve", help="run the HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=positive_int, default=1,
                   help="API processes (uvicorn workers)")
    p.add_argument("--embedded", action="store_true",
                   help="a whole farm on this machine: SQLite, local blobs, workers beside the API")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("submit", help="submit a build job")
    p.add_argument("entrypoint", metavar="ENTRYPOINT",
                   help="'package.module:factory' returning an nn.Module (or a function, "
                        "with --function)")
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--input", "-i", dest="inputs", metavar="SPEC", type=input_spec,
                   action="append", required=True,
                   help="input spec, once per positional input, e.g. float32[8,64] or "
                        "float32[2..64,128]")
    p.add_argument("--kwargs", type=json_object, default={}, metavar="JSON",
                   help="JSON object of factory keyword arguments")
    p.add_argument("--target", dest="targets", action="append", type=target_selector,
                   default=[], metavar="T",
                   help="target or selector to build for (repeatable); default: every live "
                        "target")
    p.add_argument("--mode", choices=COMPILE_MODES, default="default", help="compile mode")
    p.add_argument("--train", action="store_true", help="build for training (grad enabled)")
    p.add_argument("--function", action="store_true",
                   help="ENTRYPOINT is a free function compiled as it is, not a factory")
    p.add_argument("--wait", action="store_true", help="wait for the builds, showing progress")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with --wait: give up after S seconds")
    _add_json(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="a job's state, per target")
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument("--log", action="store_true", help="print the build logs as well")
    _add_json(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("resolve", help="which artifact a node would load")
    _add_resolve_args(p)
    _add_json(p)
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser("fetch", help="download and verify an artifact to a file")
    _add_resolve_args(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", type=Path)
    _add_json(p)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("prefetch", help="warm this node's artifact cache before a rollout")
    _add_resolve_args(p)
    _add_json(p)
    p.set_defaults(func=cmd_prefetch)

    p = sub.add_parser("models", help="models, versions and aliases")
    _add_json(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("targets", help="targets with live compile workers")
    _add_json(p)
    p.set_defaults(func=cmd_targets)

    p = sub.add_parser("alias", help="manage aliases")
    alias_sub = p.add_subparsers(dest="alias_command", metavar="ACTION", required=True)
    a = alias_sub.add_parser("set", help="point NAME@ALIAS at VERSION")
    a.add_argument("name", metavar="NAME")
    a.add_argument("alias", metavar="ALIAS")
    a.add_argument("version", metavar="VERSION")
    _add_json(a)
    a.set_defaults(func=cmd_alias_set)

    p = sub.add_parser("token", help="manage API tokens")
    token_sub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    t = token_sub.add_parser("create", help="create a token; it is printed once")
    t.add_argument("name", metavar="NAME")
    t.add_argument("--role", choices=("read", "submit", "admin"), required=True)
    t.add_argument("--db", action="store_true",
                   help="write it straight into $DATABASE_URL (on the farm's host, e.g. for "
                        "the first admin token) instead of asking the API with an admin token")
    _add_json(t)
    t.set_defaults(func=cmd_token_create)

    p = sub.add_parser("worker", help="run a Celery worker")
    p.add_argument("kind", choices=("trace", "compile"))
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="compile workers: the device to build for (default: cuda if present)")
    p.add_argument("--concurrency", type=positive_int, default=1)
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("db", help="the metadata database's schema ($DATABASE_URL)")
    db_sub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    d = db_sub.add_parser("upgrade", help="migrate to REVISION (default: head)")
    d.add_argument("revision", nargs="?", default="head")
    d.set_defaults(func=cmd_db)
    d = db_sub.add_parser("downgrade", help="migrate back to REVISION (e.g. -1, base)")
    d.add_argument("revision")
    d.set_defaults(func=cmd_db)
    d = db_sub.add_parser("current", help="the database's revision")
    d.set_defaults(func=cmd_db)

    p = sub.add_parser("demo", help="the whole loop on this machine, in one command",
                       add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="passed to the demo")
    p.set_defaults(func=cmd_demo)
    return parser


# --- output helpers -------------------------------------------------------------------


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def _client(args: argparse.Namespace) -> Any:
    from farm.node.client import FarmClient

    return FarmClient(url=args.url)


def _human_size(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _short_target(text: str) -> str:
    """``cuda/gpu=NVIDIA%20H200/...`` -> ``cuda NVIDIA H200``; ``cpu/.../isa=avx2/...`` ->
    ``cpu avx2``: enough to tell a job's builds apart on one progress line."""
    try:
        t = Target.parse(text)
    except TargetError:
        return text
    if t.device == "cuda":
        return f"cuda {t.gpu_name}"
    return f"cpu {t.cpu_isa or ''}".strip() + (f" x{t.threads}" if t.threads else "")


class Progress:
    """Job progress on stderr: one updating line on a terminal, else a line per change."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.last = ""
        self.width = 0

    def __call__(self, view: dict[str, Any]) -> None:
        builds = view.get("builds") or []
        per = ", ".join(f"{_short_target(str(b.get('target')))}: {b.get('state')}"
                        for b in builds) or "tracing"
        summary = f"job {str(view.get('id', ''))[:8]} {view.get('state')}  [{per}]"
        elapsed = time.monotonic() - self.start
        if self.tty:
            line = f"{summary}  {elapsed:.0f}s"
            pad = max(0, self.width - len(line))
            self.stream.write(f"\r{line}{' ' * pad}")
            self.width = len(line)
            self.stream.flush()
        elif summary != self.last:
            self.stream.write(f"{summary}  {elapsed:.0f}s\n")
            self.stream.flush()
        self.last = summary

    def finish(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def _job_lines(view: dict[str, Any], *, with_log: bool = False) -> list[str]:
    lines = [f"job {view.get('id')}  {view.get('model')}@{view.get('version')}  "
             f"{view.get('state')}"]
    if view.get("trace_s") is not None:
        lines.append(f"  traced in {view['trace_s']:.1f} s, {view.get('param_count') or 0:,} "
                     f"params")
    if view.get("error"):
        lines.append(f"  error: {_first_line(view['error'])}")
    for b in view.get("builds") or []:
        bits = [str(b.get("state"))]
        if b.get("compile_s") is not None:
            bits.append(f"compiled in {b['compile_s']:.1f} s")
        if b.get("artifact_bytes"):
            bits.append(_human_size(b["artifact_bytes"]))
        if b.get("max_abs_err") is not None:
            bits.append(f"max abs err {b['max_abs_err']:.2g}")
        if b.get("first_call_compiles"):
            bits.append("FIRST CALL STILL COMPILES")
        lines.append(f"  {b.get('target')}: {', '.join(bits)}")
        if b.get("error"):
            lines.append(f"    error: {_first_line(b['error'])}")
        if with_log and b.get("log"):
            lines.extend("    | " + ln for ln in str(b["log"]).splitlines())
    return lines


def _first_line(text: Any) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def _resolve_target(text: str) -> Target:
    from farm.core.target import detect_local_target

    if text.startswith("auto"):
        device = text.partition(":")[2] or None
        return detect_local_target(device, check_compiler=False)
    return Target.parse(text)


# --- commands ---------------------------------------------------------------------------


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
    try:
        spec = JobSpec(
            name=args.name,
            version=args.version,
            model=ModelRef(entrypoint=args.entrypoint, kwargs=args.kwargs,
                           kind="function" if args.function else "factory"),
            inputs=tuple(args.inputs),
            grad_mode=GradMode.TRAINING if args.train else GradMode.INFERENCE,
            options=CompileOptions(mode=args.mode),
            targets=tuple(args.targets),
        )
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    client = _client(args)
    job = client.submit(spec)
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
    from farm.node.client import NotFoundError, format_rejections

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


# --- main ------------------------------------------------------------------------------


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"farm: error: {_first_line(message) or 'failed'}\n")
    sys.stderr.flush()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "demo":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        # argparse.REMAINDER does not take a leading '--option': the demo owns them.
        args.demo_args = [*extra, *args.demo_args]
    level = logging.WARNING if args.verbose == 0 else (
        logging.INFO if args.verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="farm: %(name)s: %(message)s")
    if args.url:
        args.url = args.url.rstrip("/")

    from farm.core.signing import SigningKeyError
    from farm.node.cache import CacheError
    from farm.node.client import FarmError

    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except (SpecError, TargetError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except (CommandFailed, FarmError, CacheError, SigningKeyError) as exc:
        return _fail(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        sys.stderr.write("\nfarm: interrupted\n")
        return 130
    except BrokenPipeError:
        # `farm models | head`: the reader left; say nothing.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return EXIT_FAILURE
    except Exception as exc:
        # Domain errors of the server-side commands (db, token) and OS errors:
        # still one line; -v shows the traceback.
        if args.verbose:
            log.exception("failed")
        return _fail(f"{type(exc).__name__}: {exc}" if not _is_expected(exc) else str(exc),
                     EXIT_FAILURE)


def _is_expected(exc: BaseException) -> bool:
    try:
        from registry.db import DatabaseError
    except Exception:  # pragma: no cover - registry not importable
        return isinstance(exc, OSError)
    return isinstance(exc, (DatabaseError, OSError))


if __name__ == "__main__":
    sys.exit(main())
