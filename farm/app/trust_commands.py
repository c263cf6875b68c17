"""The `farm keys` and `farm verify` subcommands: builder and name keys, the
root-signed trust list, and checking an attested file on a node
(docs/security.md)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from farm.app.console import CommandFailed, UsageError, _json_text, _print_json, answer
from farm.app.subcommands import farm_client


def _write_private(path: Path, pem: str) -> None:
    """A private key file, 0600 from its first byte, never over an existing one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} exists; keys are never overwritten: pick another name") from None
    with os.fdopen(fd, "w") as f:
        f.write(pem)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from farm.core import attest
    from farm.core.keys import generate_keypair

    private, public = generate_keypair()
    out: Path = args.out
    _write_private(out, private)
    pub = out.with_name(out.name + ".pub")
    pub.write_text(public)
    kid = attest.keyid(public)
    return answer(args, {"private_key": str(out), "public_key": str(pub), "keyid": kid},
                  lambda _: [f"{out}  (private, 0600; keep it {args.keep_note})",
                             f"{pub}  (public)", f"keyid {kid}"])


def cmd_keys_enroll(args: argparse.Namespace) -> int:
    client = farm_client(args)
    if args.public_key is not None:
        try:
            pem = Path(args.public_key).read_text()
        except OSError as exc:
            raise UsageError(f"--public-key {args.public_key}: {exc}") from None
    elif args.role == "names":
        # The API's own name key, as it reports it: check the keyid against
        # the API host's key file before signing a trust list with it.
        pem = client.keys()["name_key"]["public_key"]
    else:
        raise UsageError("--public-key FILE is needed for a builder key")
    return answer(args, client.enroll_key(args.name, args.role, pem), lambda rec: [
        f"enrolled {rec['role']} key {rec['keyid']} ({rec['name']}); nodes trust it once "
        "`farm keys sign-trust-list --root-key ROOT.pem` has signed a list with it"])


def _keys_lines(body: dict[str, Any]) -> Iterator[str]:
    for k in body.get("keys", []):
        state = f"revoked {k['revoked_at']}: {k.get('revoked_reason') or ''}" \
            if k.get("revoked_at") else "enrolled"
        yield f"{k['keyid'][:16]}  {k['role']:<8} {k['name']}  ({state})"
    nk = body.get("name_key") or {}
    yield f"API name key: {str(nk.get('keyid'))[:16]}"


def cmd_keys_list(args: argparse.Namespace) -> int:
    return answer(args, farm_client(args).keys(), _keys_lines)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    rec = farm_client(args).revoke_key(args.keyid, reason=args.reason or "")
    return answer(args, rec, lambda r: [
        f"revoked {r['keyid']} ({r['name']}); nodes refuse it once the next trust list is "
        "signed: `farm keys sign-trust-list --root-key ROOT.pem`"])


def cmd_keys_sign_trust_list(args: argparse.Namespace) -> int:
    """Read the enrolled keys from the API, sign the list here with the root
    key (which never leaves this machine) and upload the envelope."""
    from farm.core import attest
    from farm.core.keys import SigningKeyError, load_private_key

    try:
        root = load_private_key(args.root_key)
    except SigningKeyError as exc:
        raise UsageError(f"--root-key: {exc}") from None
    client = farm_client(args)
    body = client.keys()
    keys = [k for k in body.get("keys", []) if not k.get("revoked_at")]
    revoked = [{"keyid": k["keyid"], "reason": k.get("revoked_reason") or ""}
               for k in body.get("keys", []) if k.get("revoked_at")]
    current = client.trust_list_version()
    payload = attest.trust_list_payload(version=(current or 0) + 1, keys=keys, revoked=revoked,
                                        expires_days=args.expires_days)
    envelope = attest.sign_trust_list(root, payload)
    # What the admin signs is printed first: review before it is trusted.
    for k in payload["keys"]:
        print(f"  trust {k['role']:<8} {k['keyid'][:16]}  {k['name']}", file=sys.stderr)
    for r in payload["revoked"]:
        print(f"  revoke          {r['keyid'][:16]}  {r['reason']}", file=sys.stderr)
    if not any(k["role"] == "names" for k in payload["keys"]):
        print("  warning: no name key in the list: nodes will refuse every model name "
              "(farm keys enroll --role names)", file=sys.stderr)
    if args.output is not None:
        args.output.write_text(_json_text(envelope))
    if not args.no_upload:
        client.put_trust_list(envelope)
    signed = {"version": payload["version"], "expires": payload["expires"],
              "root_keyid": attest.keyid(root)}
    return answer(args, signed, lambda s: [
        f"trust list version {s['version']} signed by root {s['root_keyid'][:16]}, expires "
        f"{s['expires']}" + ("" if args.no_upload else "; uploaded")])


def cmd_verify(args: argparse.Namespace) -> int:
    """Check a file and the attestation beside it on this node, loading nothing."""
    from farm.node.errors import IntegrityError
    from farm.node.loader import verify_local_file

    path: Path = args.file
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        v = verify_local_file(path, root_key=args.root_key, target=args.target)
    except IntegrityError as exc:
        if args.json:
            _print_json({"ok": False, "error": str(exc),
                         "field": getattr(exc, "field", None)})
        raise CommandFailed(f"{path}: {exc}") from None
    out = {"ok": True, "path": str(path), "digest": v.digest, "format": v.format,
           "model": v.model, "version": v.version, "alias": v.alias, "build_key": v.build_key,
           "builder_keyid": v.builder_keyid, "trust_list_version": v.trust_list_version,
           "target": str(v.request.target)}
    return answer(args, out, lambda _: [
        f"{path}: ok  {v.model}@{v.version}" + (f" ({v.alias})" if v.alias else "")
        + f"  sha256:{v.digest[:16]}  {v.format}  built by key {v.builder_keyid[:16]}, "
        f"trust list v{v.trust_list_version}"])
