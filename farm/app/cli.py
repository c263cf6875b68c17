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

from farm.app import (
    admin_commands,
    agent_commands,
    artifact_commands,
    fleet_commands,
    pin_commands,
    trust_commands,
)
from farm.app import commands as cmd
from farm.app.console import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CommandFailed,
    UsageError,
    _first_line,
)
from farm.app.subcommands import arg, command, group
from farm.core.inputs import TensorSpec
from farm.core.specs import BACKENDS, COMPILE_MODES, GUARD_FILTERS, WEIGHT_MODES, SpecError
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
    if text in ("auto", "auto:cpu", "auto:cuda"):
        return text  # this machine's target, detected when the command runs
    try:
        return str(TargetSelector.parse(text))
    except TargetError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc} (or 'auto', 'auto:cpu', 'auto:cuda': this machine's target)") from None


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


RESOLVE_ARGS = (
    arg("model", metavar="NAME[@VERSION|@ALIAS]", type=parse_model_ref,
        help="model name; default ref: the 'latest' alias, else the newest version"),
    arg("--input", "-i", dest="inputs", metavar="SPEC", type=input_spec, action="append",
        required=True,
        help="input spec, once per input, e.g. float32[8,64]; a keyword or dict input is "
             "named: input_ids=int64[1,16], batch.x=float32[4,8]"),
    arg("--target", type=node_target, default="auto", metavar="T|auto",
        help="the node's full target; 'auto' (default) detects this machine ('auto:cpu', "
             "'auto:cuda' pick the device)"),
    arg("--train", action="store_true",
        help="an artifact for training (grad enabled); default: inference"),
    arg("--format", dest="formats", action="append", metavar="FORMAT",
        help="only artifacts of this format (aot_compile, aoti); repeatable"),
    arg("--options", type=json_object, default=None, metavar="JSON",
        help="only artifacts built with these compile options, e.g. "
             "'{\"backend\": \"eager\", \"disable_guard_check\": true}' (unnamed ones at their "
             "defaults); default: any, the defaults first"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="farm", description="torch-farm: a build farm and artifact registry "
                     "for ahead-of-time compiled PyTorch programs.",
                     epilog="FARM_URL and FARM_TOKEN come from the environment.")
    parser.add_argument("--url", help="the farm's API (default: $FARM_URL)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (repeat for debug; default: warnings only)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    command(sub, "serve", cmd.cmd_serve, "run the HTTP API",
            arg("--host", default="127.0.0.1",
                help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: "
                     "every interface)"),
            arg("--port", type=int, default=8000, help="port to listen on (default: 8000)"),
            arg("--workers", type=positive_int, default=1,
                help="API processes (uvicorn workers; default: 1)"),
            arg("--embedded", action="store_true",
                help="a whole farm on this machine: SQLite, local blobs, workers beside the API"),
            arg("--ssl-certfile", metavar="PEM", default=None,
                help="serve HTTPS with this certificate (default: $FARM_TLS_CERT)"),
            arg("--ssl-keyfile", metavar="PEM", default=None,
                help="the certificate's private key (default: $FARM_TLS_KEY)"),
            json=False)

    command(
        sub, "submit", cmd.cmd_submit, "submit a build job (the model's code goes with it)",
        arg("entrypoint", metavar="ENTRYPOINT",
            help="'package.module:factory' returning an nn.Module (or a function, with "
                 "--function), or a file: './mymodel.py:make'"),
        arg("--source", metavar="PATH", default=None,
            help="the code to ship with the job: a file, a package directory, or a directory "
                 "of import roots (default: the entrypoint module's own file or package, unless "
                 "it is installed; .gitignore is respected)"),
        arg("--wheel", dest="wheels", metavar="WHL", action="append", default=[],
            help="a wheel of your own to ship with the job (repeatable): the build workers "
                 "install it with pip --no-deps, so ship its dependencies' wheels too; never "
                 "torch, triton or the farm"),
        arg("--requirements", metavar="FILE", default=None,
            help="pinned requirements to install on the build workers: every line "
                 "'name==version', optionally with --hash=sha256:...; binary wheels only, "
                 "--no-deps"),
        arg("--name", required=True, metavar="NAME",
            help="the model's name (letters, digits, '.', '_', '-'), e.g. tinynet"),
        arg("--version", required=True, metavar="VERSION",
            help="the version this code becomes, e.g. 1; a version is never rebuilt from other "
                 "code (409), unless none of its builds succeeded"),
        arg("--project", default=None, metavar="PROJECT",
            help="the project a new model is made in (default: 'default'); your token must "
                 "be a maintainer there"),
        arg("--input", "-i", dest="inputs", metavar="SPEC", type=input_spec, action="append",
            required=True,
            help="input spec, once per input, e.g. float32[8,64] or float32[2..64,128]; a "
                 "keyword input: input_ids=int64[1,16]{0..31999}, a key of a dict input: "
                 "batch.x=float32[4,8] (0.x: positional dict)"),
        arg("--kwargs", type=json_object, default={}, metavar="JSON",
            help="JSON object of factory keyword arguments"),
        arg("--target", dest="targets", action="append", type=target_selector, default=[],
            metavar="T",
            help="target or selector to build for (repeatable), e.g. cpu or "
                 "cuda/gpu=NVIDIA%%20H200; 'auto' is this machine's own target (as resolve and "
                 "fetch detect it; 'auto:cpu', 'auto:cuda' pick the device); default: every "
                 "live target"),
        arg("--mode", choices=COMPILE_MODES, default="default",
            help="torch.compile mode (default: default)"),
        arg("--backend", choices=BACKENDS, default="inductor",
            help="torch.compile backend (default: inductor; eager, aot_eager: no code "
                 "generated, for debugging a build; AOTI packages need inductor)"),
        arg("--guard-filter", choices=GUARD_FILTERS, default="drop-unserializable",
            help="which guards the artifact keeps (default: drop-unserializable)"),
        arg("--disable-guard-check", action="store_true",
            help="the loaded artifact skips its guard check (recorded on the artifact; a call "
                 "with other shapes is then not refused)"),
        arg("--regional", action="store_true",
            help="regional compilation: each repeated block (a transformer layer) is compiled "
                 "once as a nested compile region and stamped for every layer (recorded on the "
                 "artifact and in its build key); it pays for deep models and training steps, "
                 "and can make a small model's GPU inference calls slower"),
        arg("--per-block", action="store_true",
            help="per-block compilation: each block of the model's layer list is compiled on "
                 "its own and reused for every layer that compiles to the same program and by "
                 "later builds of the project, so a new version with one layer changed "
                 "compiles that layer; the rest of the model runs eagerly (aot_compile only)"),
        arg("--weights", choices=WEIGHT_MODES, default="auto",
            help="how the build makes the weights: empty (to_empty on the build device), fake "
                 "(FakeTensors: no memory for them, the node checks its module against the "
                 "weights manifest), auto (default: fake for a CUDA build whose weights do not "
                 "fit the build GPU, else empty)"),
        arg("--train", action="store_true", help="build for training (grad enabled)"),
        arg("--loss", metavar="MODULE:FN", default=None,
            help="a training step: compile loss(model(*inputs), *targets) with its backward, "
                 "e.g. torch.nn.functional:mse_loss (implies --train)"),
        arg("--loss-targets", type=int, default=1, metavar="N",
            help="with --loss: how many of the last inputs are the loss's targets (default: 1)"),
        arg("--optimizer", default="SGD", metavar="CLASS",
            help="with --loss: the torch.optim class the node and the verifier use "
                 "(default: SGD)"),
        arg("--optimizer-kwargs", type=json_object, default={}, metavar="JSON",
            help="with --loss: the optimizer's keyword arguments, e.g. '{\"lr\": 0.01}'"),
        arg("--function", action="store_true",
            help="ENTRYPOINT is a free function compiled as it is, not a factory"),
        arg("--external-data", dest="external_data", action="append", default=[],
            metavar="NAME",
            help="with --function: a global the function captures that torch cannot save (an "
                 "nn.Module); the node supplies it at load (repeatable)"),
        arg("--rebuild", action="store_true",
            help="compile anew even where the farm has this program's artifacts, and replace "
                 "them (without it they are reused, and only a format deleted from them is "
                 "built again)"),
        arg("--wait", action="store_true", help="wait for the builds, showing progress"),
        arg("--timeout", type=float, default=None, metavar="S",
            help="with --wait: give up after S seconds"))

    command(sub, "status", cmd.cmd_status,
            "a job's state, per target (exit 1 if it failed); or a model's: versions, node "
            "reports, misses",
            arg("job_id", metavar="JOB_ID|MODEL",
                help="the job id, or a unique prefix of it (the 8 characters progress shows); "
                     "or a model name"),
            arg("--log", action="store_true",
                help="print the build logs as well (while it runs: its stages so far)"),
            arg("--wait", action="store_true",
                help="wait for the job to finish, showing progress (e.g. after Ctrl-C)"),
            arg("--timeout", type=float, default=None, metavar="S",
                help="with --wait: stop watching after S seconds (the job goes on)"))
    command(sub, "jobs", cmd.cmd_jobs, "recent jobs, newest first",
            arg("--state", choices=("queued", "tracing", "compiling", "succeeded", "failed",
                                    "partial"), default=None,
                help="only jobs in this state"),
            arg("--model", default=None, metavar="NAME", help="only jobs of this model"),
            arg("--limit", type=positive_int, default=20, metavar="N",
                help="at most N jobs (default: 20)"))
    command(sub, "resolve", cmd.cmd_resolve, "which artifact a node would load", *RESOLVE_ARGS)
    command(sub, "fetch", cmd.cmd_fetch, "download and verify an artifact to a file",
            *RESOLVE_ARGS,
            arg("-o", "--output", required=True, metavar="FILE", type=Path,
                help="where to write the artifact; its attestation goes beside it "
                     "(FILE.attestation.json)"),
            arg("--force", action="store_true", help="overwrite FILE if it exists"),
            arg("--plain", action="store_true",
                help="write torch's own file, for torch's own loader: an aot_compile "
                     "artifact's save_compiled_function bytes (torch.compiler."
                     "load_compiled_function opens them; the farm's prebuilt kernels and its "
                     "attestation stay out), an aoti package as it is"))
    command(sub, "prefetch", cmd.cmd_prefetch, "warm this node's artifact cache before a rollout",
            *RESOLVE_ARGS)
    command(sub, "models", cmd.cmd_models, "models, versions and aliases")
    artifact_commands.add_parsers(sub, model_ref=parse_model_ref)

    fleet_commands.add_parsers(sub, model_ref=parse_model_ref)
    agent_commands.add_parsers(sub)

    command(sub, "targets", cmd.cmd_targets, "targets with live compile workers")

    alias = group(sub, "alias", "manage aliases", dest="alias_command")
    command(alias, "set", admin_commands.cmd_alias_set, "point NAME@ALIAS at VERSION",
            arg("name", metavar="NAME"), arg("alias", metavar="ALIAS"),
            arg("version", metavar="VERSION"))
    command(alias, "list", admin_commands.cmd_alias_list, "NAME's aliases and every move of each",
            arg("name", metavar="NAME"),
            arg("--no-history", dest="history", action="store_false",
                help="only where each alias points now"))
    command(alias, "rm", admin_commands.cmd_alias_rm, "delete NAME@ALIAS (its history is kept)",
            arg("name", metavar="NAME"), arg("alias", metavar="ALIAS"))

    force = arg("--force", action="store_true", help="even while its jobs still build")
    delete = group(sub, "delete", "delete a model, a version or an artifact",
                   dest="delete_command", metavar="WHAT")
    command(delete, "version", admin_commands.cmd_delete,
            "NAME@VERSION: its jobs, aliases on it, and the artifacts no other version uses",
            arg("model", metavar="NAME@VERSION", type=parse_model_ref), force)
    command(delete, "model", admin_commands.cmd_delete, "NAME with every version (admin)",
            arg("name", metavar="NAME"), force)
    command(delete, "artifact", admin_commands.cmd_delete,
            "one artifact by its sha256 or a unique prefix of 4+ characters (admin)",
            arg("digest", metavar="SHA256",
                help="the digest, or a unique prefix of it (`farm artifacts` shows 12)"))

    token = group(sub, "token", "manage API tokens", dest="token_command")
    command(token, "create", admin_commands.cmd_token_create, "create a token; it is printed once",
            arg("name", metavar="NAME"),
            arg("--role", choices=("read", "submit", "admin"), default=None,
                help="the global role: read: list, resolve and fetch; submit: also submit jobs, "
                     "set aliases, delete versions; admin: also models, artifacts, tokens and "
                     "keys (default: submit when --project gives maintainer or owner somewhere, "
                     "else read)"),
            arg("--project", dest="projects", metavar="PROJECT=ROLE", action="append",
                type=admin_commands.project_role, default=[],
                help="a role in a project: reader, maintainer or owner (repeatable); without "
                     "it a submit token is a maintainer of 'default'"),
            arg("--db", action="store_true",
                help="write it straight into $DATABASE_URL (on the farm's host, e.g. for the "
                     "first admin token) instead of asking the API with an admin token"))
    command(token, "list", admin_commands.cmd_token_list, "tokens by name and role (admin)",
            arg("--revoked", action="store_true", help="include revoked tokens"))
    command(token, "revoke", admin_commands.cmd_token_revoke,
            "revoke every token named NAME (admin)",
            arg("name", metavar="NAME"))

    project = group(sub, "project", "projects and who holds which role in them",
                    dest="project_command")
    command(project, "list", admin_commands.cmd_project_list,
            "projects, their model counts and roles")
    command(project, "create", admin_commands.cmd_project_create, "a new project (admin)",
            arg("name", metavar="NAME"),
            arg("--owner", default=None, metavar="TOKEN_NAME",
                help="make this token name the project's first owner"))
    command(project, "grant", admin_commands.cmd_project_grant,
            "give TOKEN_NAME a role in PROJECT (its owner, or an admin)",
            arg("project", metavar="PROJECT"), arg("principal", metavar="TOKEN_NAME"),
            arg("role", choices=("reader", "maintainer", "owner")))
    command(project, "revoke", admin_commands.cmd_project_revoke,
            "take TOKEN_NAME's role in PROJECT away",
            arg("project", metavar="PROJECT"), arg("principal", metavar="TOKEN_NAME"))

    cache = group(sub, "cache", "the shared compile caches of targets (admin)",
                  dest="cache_command")
    command(cache, "salt", admin_commands.cmd_cache_salt,
            "a new salt for TARGET's cache: its builds stop using every entry written before",
            arg("target", metavar="TARGET", help="a full target string (farm targets)"))

    keys = group(sub, "keys", "signing keys and the trust list (docs/security.md)",
                 dest="keys_command")
    out = arg("--out", required=True, type=Path, metavar="FILE",
              help="the private key's file (created 0600, never overwritten); the public "
                   "key goes to FILE.pub")
    command(keys, "generate", trust_commands.cmd_keys_generate,
            "a new Ed25519 key pair: FILE (0600) and FILE.pub", out,
            keep_note="on the host that signs with it")
    command(keys, "generate-root", trust_commands.cmd_keys_generate,
            "the farm's root key pair; keep FILE offline", out,
            keep_note="offline; nodes pin FILE.pub")
    command(keys, "enroll", trust_commands.cmd_keys_enroll,
            "enrol a builder key, or the API's name key",
            arg("--name", required=True, help="e.g. the worker pool"),
            arg("--role", choices=("builder", "names"), required=True,
                help="builder: a compile worker's key; names: the API's name key"),
            arg("--public-key", metavar="FILE", default=None,
                help="the public key (PEM); for --role names, default: the API's own"))
    command(keys, "list", trust_commands.cmd_keys_list, "enrolled keys")
    command(keys, "revoke", trust_commands.cmd_keys_revoke,
            "revoke a key (then sign a new trust list)",
            arg("keyid", metavar="KEYID", help="the key id, or a unique prefix of it"),
            arg("--reason", default="", help="why, kept with the revocation"))
    command(keys, "sign-trust-list", trust_commands.cmd_keys_sign_trust_list,
            "sign the enrolled keys into a new trust list with the root key",
            arg("--root-key", required=True, metavar="FILE", help="the root private key"),
            arg("--expires-days", type=float, default=90.0,
                help="nodes refuse the list after this long (default 90)"),
            arg("--output", "-o", type=Path, default=None, metavar="FILE",
                help="also write the signed envelope here"),
            arg("--no-upload", action="store_true", help="only sign (with --output)"))

    pin_commands.add_parsers(sub)

    command(sub, "verify", trust_commands.cmd_verify,
            "check a fetched file and its attestation, loading nothing",
            arg("file", metavar="FILE", type=Path),
            arg("--root-key", default=None, metavar="PEM",
                help="the farm's root public key (default: $FARM_ROOT_KEY)"),
            arg("--target", default=None,
                help="the target to check against (default: this machine's)"))

    command(sub, "worker", cmd.cmd_worker, "run a Celery worker",
            arg("kind", choices=("trace", "compile")),
            arg("--device", choices=("cpu", "cuda"), default=None,
                help="compile workers: the device to build for (default: cuda if present)"),
            arg("--concurrency", type=positive_int, default=1,
                help="tasks this worker runs at once (default: 1)"),
            arg("--loglevel", default="INFO", help="Celery's log level (default: INFO)"),
            json=False)

    db = group(sub, "db", "the metadata database's schema ($DATABASE_URL)", dest="db_command")
    command(db, "upgrade", cmd.cmd_db, "migrate to REVISION (default: head)",
            arg("revision", nargs="?", default="head"), json=False)
    command(db, "downgrade", cmd.cmd_db, "migrate back to REVISION (e.g. -1, base)",
            arg("revision"), json=False)
    command(db, "current", cmd.cmd_db, "the database's revision", json=False)

    p = sub.add_parser("demo", help="the whole loop on this machine, in one command",
                       add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="passed to the demo")
    p.set_defaults(func=cmd.cmd_demo)
    return parser



def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"farm: error: {_first_line(message) or 'failed'}\n")
    sys.stderr.flush()
    return code


# What `pip install torch-farm-server` adds to a fleet node's install: the
# farm's own server packages and the services they use.
SERVER_MODULES = frozenset({"registry", "workers", "migrations",
                            "celery", "kombu", "redis", "sqlalchemy", "alembic", "boto3",
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

    from farm.core.keys import SigningKeyError
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
                     f"named {root!r} here): pip install torch-farm-server (from a clone: "
                     "pip install ./server)", EXIT_FAILURE)
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
