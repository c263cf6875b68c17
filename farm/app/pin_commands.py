"""`farm trust show|reset`: the root key this node pinned for a farm on
this machine on first use, and forgetting it (after that farm was reset
with a new FARM_HOME, so it has a new root key)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from farm.app.console import answer
from farm.app.subcommands import arg, command, group


def _pin(args: argparse.Namespace) -> tuple[str, Path]:
    from farm.core.settings import get_settings
    from farm.node.trust import pin_path

    url = (args.farm_url or args.url or get_settings().farm_url).rstrip("/")
    return url, pin_path(get_settings().resolved_cache_dir(), url)


def _keyid(path: Path) -> str | None:
    from farm.core import attest
    from farm.core.keys import SigningKeyError, load_public_key

    try:
        return attest.keyid(load_public_key(path))
    except (OSError, SigningKeyError):
        return None


def cmd_trust_show(args: argparse.Namespace) -> int:
    from farm.core.settings import get_settings

    url, pin = _pin(args)
    configured = get_settings().farm_root_key
    value: dict[str, Any] = {
        "url": url,
        "pin": str(pin),
        "pinned": pin.exists(),
        "keyid": _keyid(pin) if pin.exists() else None,
        "farm_root_key": configured or None,
    }

    def lines(v: dict[str, Any]) -> list[str]:
        if v["farm_root_key"]:
            head = [f"{url}: trusts FARM_ROOT_KEY ({v['farm_root_key']}); a pin is not used"]
        else:
            head = []
        if v["pinned"]:
            return [*head, f"{url}: root key {str(v['keyid'])[:16]} pinned on first use, in {pin}"]
        return [
            *head,
            f"{url}: no root key pinned ({pin} does not exist); a farm on this "
            "machine is pinned on first use, any other needs FARM_ROOT_KEY",
        ]

    return answer(args, value, lines)


def cmd_trust_reset(args: argparse.Namespace) -> int:
    url, pin = _pin(args)
    keyid = _keyid(pin) if pin.exists() else None
    removed = False
    if pin.exists():
        pin.unlink()
        removed = True
    value = {"url": url, "pin": str(pin), "removed": removed, "keyid": keyid}

    def lines(v: dict[str, Any]) -> list[str]:
        if not v["removed"]:
            return [f"{url}: no root key was pinned ({pin} does not exist); nothing to reset"]
        return [
            f"{url}: forgot root key {str(keyid)[:16]} (removed {pin}); the next use "
            "pins the key that farm serves now (`farm serve --embedded` prints it)"
        ]

    return answer(args, value, lines)


def add_parsers(sub: Any) -> None:
    trust = group(
        sub,
        "trust",
        "the root key this node pinned for a farm on this machine",
        dest="trust_command",
    )
    url = arg(
        "farm_url",
        metavar="URL",
        nargs="?",
        default=None,
        help="the farm (default: --url, else $FARM_URL)",
    )
    command(trust, "show", cmd_trust_show, "where the pin for URL is, and its key id", url)
    command(
        trust,
        "reset",
        cmd_trust_reset,
        "forget the root key pinned for URL (after that farm was reset): the next use "
        "trusts the key it serves then, on first use again",
        url,
    )
