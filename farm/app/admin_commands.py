"""The `farm` subcommands that administer the registry: aliases, deletions,
tokens and the compile cache's salt. Each takes the parsed arguments and
returns an exit status.

Split out of farm.app.commands; the bodies are as they were.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from farm.app.console import EXIT_OK, UsageError, _print_json, answer
from farm.app.subcommands import farm_client


def cmd_alias_set(args: argparse.Namespace) -> int:
    body = farm_client(args).set_alias(args.name, args.alias, args.version)
    moved = f"{args.name}@{args.alias} -> {args.version}"
    previous = body.get("previous")
    if previous and previous != args.version:
        moved += (f" (was {previous}; roll back with "
                  f"`farm alias set {args.name} {args.alias} {previous}`)")
    return answer(args, body, lambda _: [moved])


def _alias_lines(body: dict[str, Any], *, name: str, history: bool) -> Iterator[str]:
    now = body.get("aliases") or []
    if body.get("project"):
        yield f"{name} (project {body['project']})"
    if not now:
        yield f"{name} has no aliases (`farm alias set {name} prod VERSION`)"
    for a in now:
        yield f"{name}@{a['alias']} -> {a['version']}"
    if history:
        events = body.get("history") or []
        if events:
            yield "history, newest first:"
        for e in events:
            when = str(e.get("at") or "")[:19].replace("T", " ")
            move = (f"{e.get('previous')} -> {e['version']}" if e.get("previous")
                    else f"set to {e['version']}") if e.get("version") else \
                f"deleted (was {e.get('previous')})"
            who = f"  by {e['actor']}" if e.get("actor") else ""
            if e.get("project"):
                who += f" (project {e['project']})"
            yield f"  {when}  {e['alias']}: {move}{who}"


def cmd_alias_list(args: argparse.Namespace) -> int:
    body = farm_client(args).aliases(args.name, history=args.history)
    return answer(args, body, lambda b: _alias_lines(b, name=args.name, history=args.history))


def cmd_alias_rm(args: argparse.Namespace) -> int:
    body = farm_client(args).delete_alias(args.name, args.alias)
    return answer(args, body, lambda b: [
        f"deleted {args.name}@{args.alias} (it pointed at {b.get('version')})"])


def _deleted_lines(body: dict[str, Any]) -> list[str]:
    lines = []
    if body.get("versions"):
        lines.append(f"  versions: {', '.join(body['versions'])} ({body.get('jobs', 0)} job(s))")
    if body.get("aliases"):
        lines.append(f"  aliases: {', '.join(body['aliases'])}")
    if body.get("artifacts"):
        lines.append(f"  artifacts: {len(body['artifacts'])}, blobs removed: "
                     f"{len(body.get('blobs') or []) - len(body.get('blobs_not_deleted') or [])}")
    if body.get("blobs_not_deleted"):
        lines.append(f"  warning: {len(body['blobs_not_deleted'])} blob(s) could not be "
                     "removed from the blob store (harmless, they are unreferenced)")
    return lines


def cmd_delete(args: argparse.Namespace) -> int:
    client = farm_client(args)
    what = args.delete_command
    if what == "artifact":
        from farm.app.artifact_commands import find_digest

        body = client.delete_artifact(find_digest(client, args.digest))
        title = f"deleted artifact {body.get('digest', args.digest)[:12]}"
    elif what == "version":
        name, ref = args.model
        if ref is None:
            raise UsageError("give the version to delete as NAME@VERSION "
                             "(`farm delete model NAME` deletes all of them)")
        body = client.delete_version(name, ref, force=args.force)
        title = f"deleted {name}@{ref}"
    else:
        body = client.delete_model(args.name, force=args.force)
        title = f"deleted model {args.name}"
    return answer(args, body, lambda b: [title, *_deleted_lines(b)])


def project_role(text: str) -> tuple[str, str]:
    """``--project P=ROLE`` as (project, role)."""
    project, sep, role = text.partition("=")
    if not sep or not project or role not in ("reader", "maintainer", "owner"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PROJECT=ROLE, ROLE one of reader, maintainer, owner "
            "(e.g. --project payments=maintainer)")
    return project, role


def _token_roles(args: argparse.Namespace) -> tuple[str, dict[str, str] | None]:
    """(global role, project roles or None): a token given maintainer or
    owner in a project is a submit token unless --role says otherwise."""
    projects = dict(args.projects) if args.projects else None
    role = args.role or ("submit" if projects and set(projects.values()) - {"reader"}
                         else "read")
    return role, projects


def cmd_token_create(args: argparse.Namespace) -> int:
    args.role, projects = _token_roles(args)
    if args.db:
        from farm.core.settings import get_settings
        from registry.auth import create_token
        from registry.db import Database

        db = Database(get_settings().resolved_database_url(), check=True)
        try:
            token = create_token(db, args.name, args.role, projects, by="farm token create --db")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        finally:
            db.dispose()
    else:
        token = str(farm_client(args).create_token(args.name, args.role, projects)["token"])
    roles = ", ".join(f"{r} of {p}" for p, r in (projects or {}).items())
    if args.json:
        _print_json({"name": args.name, "role": args.role, "projects": projects or {},
                     "token": token})
    else:
        print(token)
        print(f"farm: {args.role} token {args.name!r} created"
              f"{f' ({roles})' if roles else ''}; it is shown only this once", file=sys.stderr)
    return EXIT_OK


def _project_lines(projects: list[dict[str, Any]]) -> Iterator[str]:
    if not projects:
        yield "no projects (an admin makes one: farm project create NAME)"
    for p in projects:
        yield f"{p['project']}  ({p.get('models', 0)} model(s))"
        for r in p.get("roles") or []:
            yield f"  {r['role']:<10}  {r['principal']}"


def cmd_project_list(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).projects(), _project_lines)


def cmd_project_create(args: argparse.Namespace) -> int:
    body = farm_client(args).create_project(args.name, owner=args.owner)
    return answer(args, body, lambda b: [
        f"created project {b['project']}"
        + (f", owned by {b['owner']}" if b.get("owner") else "")
        + f" (grant roles: farm project grant {b['project']} TOKEN_NAME maintainer)"])


def cmd_project_grant(args: argparse.Namespace) -> int:
    body = farm_client(args).grant(args.project, args.principal, args.role)
    return answer(args, body, lambda b: [
        f"{b['principal']} is {b['role']} of {b['project']}"
        + (f" (was {b['previous']})" if b.get("previous") else "")])


def cmd_project_revoke(args: argparse.Namespace) -> int:
    body = farm_client(args).revoke_role(args.project, args.principal)
    return answer(args, body, lambda b: [
        f"{b['principal']} is no longer {b['revoked']} of {b['project']}"])


def cmd_cache_salt(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).new_cache_salt(args.target), lambda a: [
        f"{a['target']}: compile cache salt {a['old_salt']} -> {a['salt']}; its builds start "
        "from an empty shared cache"])


def _tokens_lines(tokens: list[dict[str, Any]]) -> Iterator[str]:
    if not tokens:
        yield "no tokens (besides FARM_ADMIN_TOKEN, which is never stored)"
    for t in tokens:
        when = str(t.get("created_at") or "")[:19].replace("T", " ")
        roles = ", ".join(f"{r} of {p}" for p, r in sorted((t.get("projects") or {}).items()))
        yield (f"{t['name']}  {t['role']}  created {when}" + (f"  ({roles})" if roles else "")
               + ("  REVOKED" if t.get("revoked") else ""))


def cmd_token_list(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).tokens(revoked=args.revoked), _tokens_lines)


def cmd_token_revoke(args: argparse.Namespace) -> int:
    n = farm_client(args).revoke_token(args.name)
    return answer(args, {"name": args.name, "revoked": n}, lambda _: [
        f"revoked {n} token(s) named {args.name!r} (effective within a few seconds)"])
