"""``farm agent`` and ``farm run``: a warm node process that forks a child per
script with torch, Dynamo and Inductor already imported (farm.node.agent)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from farm.app.subcommands import arg, command


def add_parsers(sub: Any) -> None:
    command(sub, "agent", cmd_agent,
            "a warm node agent: forks `farm run` scripts with torch, Dynamo and Inductor "
            "already imported",
            arg("--socket", type=Path, default=None, metavar="PATH",
                help="the unix socket (default: $FARM_AGENT_SOCKET, "
                     "$XDG_RUNTIME_DIR/farm-agent.sock, else agent.sock in the node's cache "
                     "dir); one agent per socket: per node, or per GPU"),
            json=False)
    command(sub, "run", cmd_run,
            "run `python SCRIPT ARGS...` in a fork of the node agent (runs it directly when no "
            "agent answers)",
            arg("--agent", type=Path, default=None, metavar="PATH",
                help="the agent's socket (default: as `farm agent`'s)"),
            arg("command", nargs=argparse.REMAINDER, metavar="-- python SCRIPT ARGS..."),
            json=False)


def cmd_agent(args: argparse.Namespace) -> int:
    from farm.node.agent import main

    return main(socket_path=args.socket)


def cmd_run(args: argparse.Namespace) -> int:
    from farm.node.run import run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    run(command, agent=args.agent)
