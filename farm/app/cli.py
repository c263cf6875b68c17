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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from farm.app import agent_commands, fleet_commands
from farm.app import commands as cmd
from farm.app.console import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CommandFailed,
    UsageError,
    _first_line,
)
from farm.core.specs import (
    BACKENDS,
    COMPILE_MODES,
    GUARD_FILTERS,
    WEIGHT_MODES,
    SpecError,
    TensorSpec,
)
from farm.core.target import Target, TargetError, TargetSelector

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")

log = logging.getLogger(__name__)


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
                   help="input spec, once per input, e.g. float32[8,64]; a keyword or dict "
                        "input is named: input_ids=int64[1,16], batch.x=float32[4,8]")
    p.add_argument("--target", type=node_target, default="auto", metavar="T|auto",
                   help="the node's full target; 'auto' (default) detects this machine "
                        "('auto:cpu', 'auto:cuda' pick the device)")
    p.add_argument("--train", action="store_true",
                   help="an artifact for training (grad enabled); default: inference")
    p.add_argument("--format", dest="formats", action="append", metavar="FORMAT",
                   help="only artifacts of this format (aot_compile, aoti); repeatable")
    p.add_argument("--options", type=json_object, default=None, metavar="JSON",
                   help="only artifacts built with these compile options, e.g. "
                        "'{\"backend\": \"eager\", \"disable_guard_check\": true}' "
                        "(unnamed ones at their defaults); default: any, the defaults first")


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
    p.add_argument("--ssl-certfile", metavar="PEM", default=None,
                   help="serve HTTPS with this certificate (default: $FARM_TLS_CERT)")
    p.add_argument("--ssl-keyfile", metavar="PEM", default=None,
                   help="the certificate's private key (default: $FARM_TLS_KEY)")
    p.set_defaults(func=cmd.cmd_serve)

    p = sub.add_parser("submit", help="submit a build job (the model's code goes with it)")
    p.add_argument("entrypoint", metavar="ENTRYPOINT",
                   help="'package.module:factory' returning an nn.Module (or a function, "
                        "with --function), or a file: './mymodel.py:make'")
    p.add_argument("--source", metavar="PATH", default=None,
                   help="the code to ship with the job: a file, a package directory, or a "
                        "directory of import roots (default: the entrypoint module's own file "
                        "or package, unless it is installed; .gitignore is respected)")
    p.add_argument("--wheel", dest="wheels", metavar="WHL", action="append", default=[],
                   help="a wheel of your own to ship with the job (repeatable): the build "
                        "workers install it with pip --no-deps, so ship its dependencies' "
                        "wheels too; never torch, triton or the farm")
    p.add_argument("--requirements", metavar="FILE", default=None,
                   help="pinned requirements to install on the build workers: every line "
                        "'name==version', optionally with --hash=sha256:...; binary wheels "
                        "only, --no-deps")
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--input", "-i", dest="inputs", metavar="SPEC", type=input_spec,
                   action="append", required=True,
                   help="input spec, once per input, e.g. float32[8,64] or "
                        "float32[2..64,128]; a keyword input: input_ids=int64[1,16]{0..31999}, "
                        "a key of a dict input: batch.x=float32[4,8] (0.x: positional dict)")
    p.add_argument("--kwargs", type=json_object, default={}, metavar="JSON",
                   help="JSON object of factory keyword arguments")
    p.add_argument("--target", dest="targets", action="append", type=target_selector,
                   default=[], metavar="T",
                   help="target or selector to build for (repeatable); default: every live "
                        "target")
    p.add_argument("--mode", choices=COMPILE_MODES, default="default", help="compile mode")
    p.add_argument("--backend", choices=BACKENDS, default="inductor",
                   help="torch.compile backend (eager, aot_eager: no code generated, for "
                        "debugging a build; AOTI packages need inductor)")
    p.add_argument("--guard-filter", choices=GUARD_FILTERS, default="drop-unserializable",
                   help="which guards the artifact keeps")
    p.add_argument("--disable-guard-check", action="store_true",
                   help="the loaded artifact skips its guard check (recorded on the artifact; "
                        "a call with other shapes is then not refused)")
    p.add_argument("--regional", action="store_true",
                   help="regional compilation: each repeated block (a transformer layer) is "
                        "compiled once as a nested compile region and stamped for every layer "
                        "(recorded on the artifact and in its build key)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="auto",
                   help="how the build makes the weights: empty (to_empty on the build device), "
                        "fake (FakeTensors: no memory for them, the node checks its module "
                        "against the weights manifest), auto (default: fake for a CUDA build "
                        "whose weights do not fit the build GPU, else empty)")
    p.add_argument("--train", action="store_true", help="build for training (grad enabled)")
    p.add_argument("--loss", metavar="MODULE:FN", default=None,
                   help="a training step: compile loss(model(*inputs), *targets) with its "
                        "backward, e.g. torch.nn.functional:mse_loss (implies --train)")
    p.add_argument("--loss-targets", type=int, default=1, metavar="N",
                   help="with --loss: how many of the last inputs are the loss's targets")
    p.add_argument("--optimizer", default="SGD", metavar="CLASS",
                   help="with --loss: the torch.optim class the node and the verifier use")
    p.add_argument("--optimizer-kwargs", type=json_object, default={}, metavar="JSON",
                   help="with --loss: the optimizer's keyword arguments, e.g. '{\"lr\": 0.01}'")
    p.add_argument("--function", action="store_true",
                   help="ENTRYPOINT is a free function compiled as it is, not a factory")
    p.add_argument("--external-data", dest="external_data", action="append", default=[],
                   metavar="NAME",
                   help="with --function: a global the function captures that torch cannot "
                        "save (an nn.Module); the node supplies it at load (repeatable)")
    p.add_argument("--wait", action="store_true", help="wait for the builds, showing progress")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with --wait: give up after S seconds")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_submit)

    p = sub.add_parser("status", help="a job's state, per target (exit 1 if it failed); or "
                                      "a model's: versions, node reports, misses")
    p.add_argument("job_id", metavar="JOB_ID|MODEL",
                   help="the job id, or a unique prefix of it (the 8 characters progress "
                        "shows); or a model name")
    p.add_argument("--log", action="store_true",
                   help="print the build logs as well (while it runs: its stages so far)")
    p.add_argument("--wait", action="store_true",
                   help="wait for the job to finish, showing progress (e.g. after Ctrl-C)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with --wait: stop watching after S seconds (the job goes on)")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_status)

    p = sub.add_parser("jobs", help="recent jobs, newest first")
    p.add_argument("--state", choices=("queued", "tracing", "compiling", "succeeded", "failed",
                                       "partial"), default=None)
    p.add_argument("--model", default=None, metavar="NAME")
    p.add_argument("--limit", type=positive_int, default=20, metavar="N")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_jobs)

    p = sub.add_parser("resolve", help="which artifact a node would load")
    _add_resolve_args(p)
    _add_json(p)
    p.set_defaults(func=cmd.cmd_resolve)

    p = sub.add_parser("fetch", help="download and verify an artifact to a file")
    _add_resolve_args(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", type=Path)
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_fetch)

    p = sub.add_parser("prefetch", help="warm this node's artifact cache before a rollout")
    _add_resolve_args(p)
    _add_json(p)
    p.set_defaults(func=cmd.cmd_prefetch)

    p = sub.add_parser("models", help="models, versions and aliases")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_models)

    fleet_commands.add_parsers(sub, add_json=_add_json, model_ref=parse_model_ref)
    agent_commands.add_parsers(sub)

    p = sub.add_parser("targets", help="targets with live compile workers")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_targets)

    p = sub.add_parser("alias", help="manage aliases")
    alias_sub = p.add_subparsers(dest="alias_command", metavar="ACTION", required=True)
    a = alias_sub.add_parser("set", help="point NAME@ALIAS at VERSION")
    a.add_argument("name", metavar="NAME")
    a.add_argument("alias", metavar="ALIAS")
    a.add_argument("version", metavar="VERSION")
    _add_json(a)
    a.set_defaults(func=cmd.cmd_alias_set)
    a = alias_sub.add_parser("list", help="NAME's aliases and every move of each")
    a.add_argument("name", metavar="NAME")
    a.add_argument("--no-history", dest="history", action="store_false",
                   help="only where each alias points now")
    _add_json(a)
    a.set_defaults(func=cmd.cmd_alias_list)
    a = alias_sub.add_parser("rm", help="delete NAME@ALIAS (its history is kept)")
    a.add_argument("name", metavar="NAME")
    a.add_argument("alias", metavar="ALIAS")
    _add_json(a)
    a.set_defaults(func=cmd.cmd_alias_rm)

    p = sub.add_parser("delete", help="delete a model, a version or an artifact")
    del_sub = p.add_subparsers(dest="delete_command", metavar="WHAT", required=True)
    d = del_sub.add_parser("version", help="NAME@VERSION: its jobs, aliases on it, and the "
                           "artifacts no other version uses")
    d.add_argument("model", metavar="NAME@VERSION", type=parse_model_ref)
    d.add_argument("--force", action="store_true", help="even while its jobs still build")
    _add_json(d)
    d.set_defaults(func=cmd.cmd_delete)
    d = del_sub.add_parser("model", help="NAME with every version (admin)")
    d.add_argument("name", metavar="NAME")
    d.add_argument("--force", action="store_true", help="even while its jobs still build")
    _add_json(d)
    d.set_defaults(func=cmd.cmd_delete)
    d = del_sub.add_parser("artifact", help="one artifact by its sha256 (admin)")
    d.add_argument("digest", metavar="SHA256")
    _add_json(d)
    d.set_defaults(func=cmd.cmd_delete)

    p = sub.add_parser("token", help="manage API tokens")
    token_sub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    t = token_sub.add_parser("create", help="create a token; it is printed once")
    t.add_argument("name", metavar="NAME")
    t.add_argument("--role", choices=("read", "submit", "admin"), required=True)
    t.add_argument("--db", action="store_true",
                   help="write it straight into $DATABASE_URL (on the farm's host, e.g. for "
                        "the first admin token) instead of asking the API with an admin token")
    _add_json(t)
    t.set_defaults(func=cmd.cmd_token_create)
    t = token_sub.add_parser("list", help="tokens by name and role (admin)")
    t.add_argument("--revoked", action="store_true", help="include revoked tokens")
    _add_json(t)
    t.set_defaults(func=cmd.cmd_token_list)
    t = token_sub.add_parser("revoke", help="revoke every token named NAME (admin)")
    t.add_argument("name", metavar="NAME")
    _add_json(t)
    t.set_defaults(func=cmd.cmd_token_revoke)

    p = sub.add_parser("cache", help="the shared compile caches of targets (admin)")
    cache_sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    c = cache_sub.add_parser("salt", help="a new salt for TARGET's cache: its builds stop "
                                          "using every entry written before")
    c.add_argument("target", metavar="TARGET", help="a full target string (farm targets)")
    _add_json(c)
    c.set_defaults(func=cmd.cmd_cache_salt)

    p = sub.add_parser("keys", help="signing keys and the trust list (docs/security.md)")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    k = keys_sub.add_parser("generate", help="a new Ed25519 key pair: FILE (0600) and FILE.pub")
    k.add_argument("--out", required=True, type=Path, metavar="FILE")
    k.set_defaults(func=cmd.cmd_keys_generate, keep_note="on the host that signs with it")
    _add_json(k)
    k = keys_sub.add_parser("generate-root", help="the farm's root key pair; keep FILE offline")
    k.add_argument("--out", required=True, type=Path, metavar="FILE")
    k.set_defaults(func=cmd.cmd_keys_generate, keep_note="offline; nodes pin FILE.pub")
    _add_json(k)
    k = keys_sub.add_parser("enroll", help="enrol a builder key, or the API's name key")
    k.add_argument("--name", required=True, help="e.g. the worker pool")
    k.add_argument("--role", choices=("builder", "names"), required=True)
    k.add_argument("--public-key", metavar="FILE", default=None,
                   help="the public key (PEM); for --role names, default: the API's own")
    _add_json(k)
    k.set_defaults(func=cmd.cmd_keys_enroll)
    k = keys_sub.add_parser("list", help="enrolled keys")
    _add_json(k)
    k.set_defaults(func=cmd.cmd_keys_list)
    k = keys_sub.add_parser("revoke", help="revoke a key (then sign a new trust list)")
    k.add_argument("keyid", metavar="KEYID", help="the key id, or a unique prefix of it")
    k.add_argument("--reason", default="")
    _add_json(k)
    k.set_defaults(func=cmd.cmd_keys_revoke)
    k = keys_sub.add_parser("sign-trust-list",
                            help="sign the enrolled keys into a new trust list with the root key")
    k.add_argument("--root-key", required=True, metavar="FILE", help="the root private key")
    k.add_argument("--expires-days", type=float, default=90.0,
                   help="nodes refuse the list after this long (default 90)")
    k.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                   help="also write the signed envelope here")
    k.add_argument("--no-upload", action="store_true", help="only sign (with --output)")
    _add_json(k)
    k.set_defaults(func=cmd.cmd_keys_sign_trust_list)

    p = sub.add_parser("verify", help="check a fetched file and its attestation, loading nothing")
    p.add_argument("file", metavar="FILE", type=Path)
    p.add_argument("--root-key", default=None, metavar="PEM",
                   help="the farm's root public key (default: $FARM_ROOT_KEY)")
    p.add_argument("--target", default=None,
                   help="the target to check against (default: this machine's)")
    _add_json(p)
    p.set_defaults(func=cmd.cmd_verify)

    p = sub.add_parser("worker", help="run a Celery worker")
    p.add_argument("kind", choices=("trace", "compile"))
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="compile workers: the device to build for (default: cuda if present)")
    p.add_argument("--concurrency", type=positive_int, default=1)
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd.cmd_worker)

    p = sub.add_parser("db", help="the metadata database's schema ($DATABASE_URL)")
    db_sub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    d = db_sub.add_parser("upgrade", help="migrate to REVISION (default: head)")
    d.add_argument("revision", nargs="?", default="head")
    d.set_defaults(func=cmd.cmd_db)
    d = db_sub.add_parser("downgrade", help="migrate back to REVISION (e.g. -1, base)")
    d.add_argument("revision")
    d.set_defaults(func=cmd.cmd_db)
    d = db_sub.add_parser("current", help="the database's revision")
    d.set_defaults(func=cmd.cmd_db)

    p = sub.add_parser("demo", help="the whole loop on this machine, in one command",
                       add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="passed to the demo")
    p.set_defaults(func=cmd.cmd_demo)
    return parser



def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"farm: error: {_first_line(message) or 'failed'}\n")
    sys.stderr.flush()
    return code


# What `pip install 'torch-farm[server]'` adds to a fleet node's install.
SERVER_MODULES = frozenset({"celery", "kombu", "redis", "sqlalchemy", "alembic", "boto3",
                            "botocore", "fastapi", "starlette", "uvicorn", "prometheus_client",
                            "psutil", "cachetools", "psycopg"})


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
    from farm.node.errors import FarmError, FarmUnavailable

    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except (SpecError, TargetError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except FarmUnavailable as exc:
        return _fail(_unreachable_hint(str(exc), exc.status, args.url), EXIT_FAILURE)
    except (CommandFailed, FarmError, CacheError, SigningKeyError) as exc:
        return _fail(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        sys.stderr.write("\nfarm: interrupted\n")
        return 130
    except ModuleNotFoundError as exc:
        root = (exc.name or "").partition(".")[0]
        if root not in SERVER_MODULES:
            raise
        # A fleet node's install (`pip install torch-farm`) has no server set.
        return _fail(f"farm {args.command} needs the farm's server packages (no module "
                     f"named {root!r} here): pip install 'torch-farm[server]'", EXIT_FAILURE)
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


def _unreachable_hint(message: str, status: int | None, url: str | None) -> str:
    """Nothing answered at all (no HTTP status): say how to get a farm there."""
    if status is not None:
        return message
    where = "--url" if url else ("FARM_URL" if os.environ.get("FARM_URL") else
                                 "the default (FARM_URL is not set)")
    return (f"{_first_line(message)}; nothing answers there (from {where}): start a farm "
            "on this machine with `farm serve --embedded`, or point FARM_URL (or --url) at "
            "yours")


def _is_expected(exc: BaseException) -> bool:
    try:
        from registry.db import DatabaseError
    except Exception:  # pragma: no cover - registry not importable
        return isinstance(exc, OSError)
    return isinstance(exc, (DatabaseError, OSError))


if __name__ == "__main__":
    sys.exit(main())
