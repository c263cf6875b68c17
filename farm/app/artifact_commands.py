"""`farm artifacts`: the artifacts of every model (or one model or version),
one a line, with the short digest that `farm delete artifact` and the other
commands taking a digest accept; and that prefix's lookup."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from typing import Any

from farm.app.console import CommandFailed, UsageError, _human_size, _short_target, answer
from farm.app.subcommands import arg, command, farm_client

# The shortest digest prefix taken for an artifact (as git takes commits).
MIN_PREFIX = 4
_HEX = re.compile(r"^[0-9a-f]+$")


def artifact_rows(
    client: Any, name: str | None = None, version: str | None = None
) -> list[dict[str, Any]]:
    """Every artifact of ``name`` (every model when None), one row per
    version that serves it, newest model first as `farm models` lists them."""
    names = [name] if name else [str(m["name"]) for m in client.models()]
    rows: list[dict[str, Any]] = []
    for n in names:
        model = client.model(n)
        # NAME@ALIAS: the version the alias points at now.
        want = (model.get("aliases") or {}).get(version, version) if version else None
        for v in model.get("versions", []):
            if want is not None and v.get("version") != want:
                continue
            for a in v.get("artifacts", []):
                rows.append({**a, "model": n, "version": v.get("version")})
    if version is not None and not rows and name:
        known = [str(v.get("version")) for v in client.model(name).get("versions", [])]
        if version not in known and version not in (client.model(name).get("aliases") or {}):
            raise CommandFailed(
                f"{name} has no version or alias {version!r}; its versions: "
                f"{', '.join(known) or 'none'}"
            )
    return rows


def find_digest(client: Any, text: str) -> str:
    """The full sha256 of the artifact whose digest starts with ``text``
    (``sha256:`` optional, at least MIN_PREFIX hex characters, unique)."""
    prefix = text.removeprefix("sha256:").lower()
    if not _HEX.match(prefix) or len(prefix) > 64:
        raise UsageError(
            f"bad digest {text!r}: hex characters (sha256), or a unique prefix of "
            f"{MIN_PREFIX} or more as `farm artifacts` shows"
        )
    if len(prefix) == 64:
        return prefix
    if len(prefix) < MIN_PREFIX:
        raise UsageError(
            f"digest prefix {text!r} is too short: give {MIN_PREFIX} or more "
            "characters (`farm artifacts` lists them)"
        )
    matches = sorted(
        {str(r["digest"]) for r in artifact_rows(client) if str(r["digest"]).startswith(prefix)}
    )
    if not matches:
        raise CommandFailed(
            f"no artifact's digest starts with {prefix!r} (`farm artifacts` lists them)"
        )
    if len(matches) > 1:
        raise CommandFailed(
            f"digest prefix {prefix!r} is ambiguous: "
            f"{', '.join(m[:12] for m in matches)}; give more characters"
        )
    return matches[0]


def _lines(rows: list[dict[str, Any]]) -> Iterator[str]:
    if not rows:
        yield "no artifacts"
        return
    for r in rows:
        inputs = ";".join(r.get("inputs") or [])
        yield (
            f"{str(r['digest'])[:12]}  {r['model']}@{r['version']}  {r.get('format')}  "
            f"{inputs} ({r.get('grad_mode')})  {_short_target(str(r.get('target', '')))}  "
            f"{_human_size(r.get('size'))}"
        )


def cmd_artifacts(args: argparse.Namespace) -> int:
    name, ref = args.model if args.model else (None, None)
    rows = artifact_rows(farm_client(args), name, ref)
    return answer(args, rows, _lines)


def add_parsers(sub: Any, *, model_ref: Any) -> None:
    command(
        sub,
        "artifacts",
        cmd_artifacts,
        "artifacts of every model, or of NAME or NAME@VERSION, with their short digests",
        arg(
            "model",
            metavar="NAME[@VERSION]",
            nargs="?",
            type=model_ref,
            default=None,
            help="only this model, or this version (default: every model)",
        ),
    )
