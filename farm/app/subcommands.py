"""How `farm`'s subcommands are declared: a parser with its arguments in
order, then ``--json`` (for a command that prints a result), and the function
that runs it (``args.func``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Arg = tuple[tuple[str, ...], dict[str, Any]]


def arg(*flags: str, **options: Any) -> Arg:
    """One ``add_argument`` call, as data: ``arg("--limit", type=int)``."""
    return flags, options


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], help: str,
            *args: Arg, json: bool = True, **defaults: Any) -> argparse.ArgumentParser:
    """The subcommand ``name`` on ``sub`` (an ``add_subparsers`` action);
    ``defaults`` are set on its namespace beside ``func``."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help)
    for flags, options in args:
        p.add_argument(*flags, **options)
    if json:
        add_json(p)
    p.set_defaults(func=func, **defaults)
    return p


def group(sub: Any, name: str, help: str, *, dest: str, metavar: str = "ACTION") -> Any:
    """A subcommand whose own subcommands are the actions (``farm alias set``)."""
    return sub.add_parser(name, help=help).add_subparsers(dest=dest, metavar=metavar,
                                                         required=True)


def farm_client(args: argparse.Namespace, *, reports: bool | None = None) -> Any:
    """The ``FarmClient`` a command talks through (``--url`` or ``FARM_URL``);
    ``reports`` as ``FarmClient``'s (None: ``FARM_REPORTS``)."""
    from farm.node.client import FarmClient

    return FarmClient(url=args.url, reports=reports)
