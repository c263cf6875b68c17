"""What a node checks before any byte of an artifact is unpickled or dlopened.

1. The trust list is signed by the root key this node pins, has not expired,
   and is not older than one this node has seen (``TrustStore``).
2. The build statement is signed by a key the list gives the ``builder``
   role, not revoked; the version and alias statements by the key it gives
   ``names``.
3. Every field is compared with the node's own request (``NodeRequest``),
   never with what the farm's answer claims: model; version (or, for an
   alias, the version the alias statement points at, and not an alias
   statement older than one seen before); the program the version is bound
   to against the one the build was made from; the build key (recomputed);
   input coverage; grad mode; target; options; format. The answer's own
   fields must agree with the statements too.
4. The bytes hash to the statement's digest and have its size
   (``check_file``; the cache does it while downloading).

A refusal is an ``AttestationRefused`` naming the field that failed.
Pure apart from ``TrustStore``'s small files and ``check_file``'s read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from farm.core import attest
from farm.core.digests import sha256_file
from farm.core.inputs import (
    TensorSpec,
    format_inputs,
    inputs_cover,
    parse_input_list,
    parse_inputs,
)
from farm.core.specs import CompileOptions, GradMode, SpecError, build_key, unasked_options
from farm.core.target import Target, TargetError
from farm.node.errors import IntegrityError

log = logging.getLogger(__name__)

BUNDLE_SUFFIX = ".attestation.json"
BUNDLE_TYPE = "https://torch-farm.dev/attestation-bundle/v1"


class AttestationRefused(IntegrityError):
    """The artifact was not attested for exactly this request; ``field`` says what differs."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"refused ({field}): {message}")
        self.field = field


@dataclass(frozen=True)
class NodeRequest:
    """What the node asked the farm for: the only thing statements are compared with."""

    model: str
    ref: str | None
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode
    target: Target
    options: CompileOptions | None = None
    formats: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "ref": self.ref, "inputs": [str(s) for s in self.inputs],
            "grad_mode": self.grad_mode.value, "target": str(self.target),
            "options": self.options.to_json() if self.options is not None else None,
            "formats": list(self.formats) if self.formats is not None else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeRequest:
        try:
            opts = data.get("options")
            formats = data.get("formats")
            return cls(model=str(data["model"]), ref=data.get("ref"),
                       inputs=parse_inputs(list(data["inputs"])),
                       grad_mode=GradMode(data.get("grad_mode", "inference")),
                       target=Target.parse(str(data["target"])),
                       options=CompileOptions.from_json(opts) if opts is not None else None,
                       formats=tuple(formats) if formats is not None else None)
        except (KeyError, TypeError, ValueError, SpecError, TargetError) as exc:
            raise AttestationRefused(f"request record is malformed: {exc}",
                                     field="request") from None


@dataclass(frozen=True)
class Verified:
    """An artifact whose statements verified for ``request``."""

    digest: str
    size: int
    format: str
    build_key: str
    model: str
    version: str
    alias: str | None
    alias_issued_at: datetime | None
    builder_keyid: str
    trust_list_version: int
    request: NodeRequest
    build: dict[str, Any] = field(repr=False, default_factory=dict)


def _refuse(msg: str, fld: str) -> AttestationRefused:
    return AttestationRefused(msg, field=fld)


def _statement(envelope: Any, trust: attest.TrustList, predicate_type: str,
               what: str) -> attest.Statement:
    if envelope is None:
        why = ("an artifact row no builder attested" if what == "build" else
               "a name no accepted request bound")
        raise _refuse(f"the farm sent no {what} statement ({why})", f"{what}_statement")
    try:
        return attest.verify_statement(envelope, trust, predicate_type=predicate_type)
    except attest.AttestationError as exc:
        fld = exc.field if exc.field in ("revoked",) else f"{what}_statement.{exc.field}"
        raise _refuse(str(exc), fld) from None


def target_mismatch(built: Target, node: Target) -> str | None:
    """The first target field that keeps ``built``'s artifact from running on
    ``node`` (the rules torch's own check and the farm's resolver apply)."""
    if built.device != node.device:
        return "target.device"
    if built.python_version != node.python_version:
        return "target.python_version"
    if built.torch_version != node.torch_version:
        return "target.torch_version"
    if built.device == "cuda":
        if built.cuda_version != node.cuda_version:
            return "target.cuda_version"
        mm = [".".join(v.split(".")[:2]) if v else None
              for v in (built.triton_version, node.triton_version)]
        if mm[0] != mm[1]:
            return "target.triton_version"
        if built.gpu_name != node.gpu_name:
            return "target.gpu_name"
        if built.capability and node.capability and built.capability != node.capability:
            return "target.capability"
    if (built.device == "cpu" or built.cpu_isa is not None) and built.cpu_isa != node.cpu_isa:
        return "target.cpu_isa"
    if built.threads is not None and built.threads != node.threads:
        return "target.threads"
    return None


def verify_attestation(
    bundle: Mapping[str, Any],
    trust: attest.TrustList,
    request: NodeRequest,
    *,
    claimed: Mapping[str, Any] | None = None,
    alias_seen: datetime | None = None,
) -> Verified:
    """Check ``bundle`` (``{"build", "version", "alias"}`` envelopes) for ``request``.

    ``claimed`` is the farm's answer for the artifact (its JSON fields); it is
    never trusted, only required to agree. ``alias_seen``: the newest alias
    statement this node accepted for ``request.model``@``request.ref``.
    """
    b = _statement(bundle.get("build"), trust, attest.BUILD_PREDICATE, "build")
    v = _statement(bundle.get("version"), trust, attest.VERSION_PREDICATE, "version")
    p = b.predicate
    raw_art = p.get("artifact")
    art: dict[str, Any] = raw_art if isinstance(raw_art, dict) else {}
    digest, size, fmt = art.get("digest"), art.get("size"), art.get("format")
    if digest != b.subject_sha256 or not isinstance(size, int) or not isinstance(fmt, str):
        raise _refuse("build statement's artifact does not match its subject", "build.artifact")

    # --- names: model, version, alias ------------------------------------------------
    vp = v.predicate
    if vp.get("model") != request.model:
        raise _refuse(f"the version statement is for model {vp.get('model')!r}, this node "
                      f"asked for {request.model!r}", "model")
    version = str(vp.get("version"))
    alias_name: str | None = None
    alias_at: datetime | None = None
    a_env = bundle.get("alias")
    ref = request.ref
    if ref is not None and ref == version:
        if a_env is not None:
            raise _refuse(f"asked for version {ref!r} and got an alias statement", "alias")
    elif ref is not None or a_env is not None:
        # An alias: asked for by name, or the default ("latest", when it exists).
        wanted = ref if ref is not None else "latest"
        if a_env is None:
            raise _refuse(f"asked for {request.model}@{wanted}, the version statement is for "
                          f"version {version!r} and no alias statement points {wanted!r} at "
                          "it", "version")
        a = _statement(a_env, trust, attest.ALIAS_PREDICATE, "alias")
        ap = a.predicate
        if ap.get("model") != request.model:
            raise _refuse(f"the alias statement is for model {ap.get('model')!r}", "model")
        if ap.get("alias") != wanted:
            raise _refuse(f"the alias statement is for alias {ap.get('alias')!r}, this node "
                          f"asked for {wanted!r}", "alias")
        if ap.get("version") != version or a.subject_sha256 != v.subject_sha256:
            raise _refuse(f"alias {wanted!r} points at version {ap.get('version')!r}, the farm "
                          f"served version {version!r}", "version")
        try:
            alias_at = attest.parse_time(ap.get("issued_at"), field="alias.issued_at")
        except attest.AttestationError as exc:
            raise _refuse(str(exc), "alias.issued_at") from None
        if alias_seen is not None and alias_at < alias_seen:
            raise _refuse(f"the alias statement for {request.model}@{wanted} was issued at "
                          f"{alias_at.isoformat()}, before the one this node already accepted "
                          f"({alias_seen.isoformat()}): an older binding replayed",
                          "alias.issued_at")
        alias_name = wanted

    # --- what the bytes were built from ----------------------------------------------
    program = vp.get("program")
    if attest.program_digest(program if isinstance(program, dict) else {}) != v.subject_sha256:
        raise _refuse("version statement's program does not match its subject", "program")
    built_from = p.get("program")
    if built_from != program:
        mine = program if isinstance(program, dict) else {}
        theirs = built_from if isinstance(built_from, dict) else {}
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise _refuse(f"the artifact was built from another program than "
                      f"{request.model}@{version} ({', '.join(diff)} differ)", "program")
    try:
        built_inputs = parse_input_list(str(p.get("inputs") or ""))
        built_mode = GradMode(p.get("grad_mode"))
        built_options = CompileOptions.from_json(p.get("options"))
        built_target = Target.parse(str(p.get("target")))
    except (SpecError, TargetError, ValueError, TypeError) as exc:
        raise _refuse(f"build statement does not parse: {exc}", "build") from None
    key = build_key(fingerprint=str(p.get("fingerprint")), inputs=built_inputs,
                    grad_mode=built_mode, options=built_options, target=str(built_target),
                    project=None if p.get("project") is None else str(p.get("project")))
    if p.get("build_key") != key:
        raise _refuse("the build key does not follow from the statement's fingerprint, inputs, "
                      "grad mode, options and target", "build_key")
    if not inputs_cover(built_inputs, request.inputs):
        raise _refuse(f"built for inputs {format_inputs(built_inputs)}, which do not cover "
                      f"{format_inputs(request.inputs)}", "inputs")
    if built_mode != request.grad_mode:
        raise _refuse(f"built for grad mode {built_mode.value}, asked for "
                      f"{request.grad_mode.value}", "grad_mode")
    if request.options is not None and built_options != request.options:
        raise _refuse(f"built with options {built_options.canonical()}, asked for "
                      f"{request.options.canonical()}", "options")
    # The farm's resolver applies the same rule; a node does not take its word.
    unasked = [] if request.options is not None else unasked_options(
        built_options, built_target.device)
    if unasked:
        raise _refuse(f"built with options the request did not ask for: {', '.join(unasked)}",
                      "options")
    mismatch = target_mismatch(built_target, request.target)
    if mismatch is not None:
        raise _refuse(f"built for {built_target}, this node is {request.target}", mismatch)
    if request.formats is not None and fmt not in request.formats:
        raise _refuse(f"format {fmt} is not one of {', '.join(request.formats)}", "format")

    # --- the answer must say the same -----------------------------------------------
    if claimed is not None:
        checks = {"digest": digest, "size": size, "format": fmt, "build_key": key}
        for name, want in checks.items():
            if name in claimed and claimed[name] != want:
                raise _refuse(f"the farm's answer says {name} {claimed[name]!r}, the build "
                              f"statement {want!r}", name)
        if "version" in claimed and claimed["version"] is not None and \
                claimed["version"] != version:
            raise _refuse(f"the farm's answer says version {claimed['version']!r}, the version "
                          f"statement {version!r}", "version")
    return Verified(digest=str(digest), size=int(size), format=fmt, build_key=key,
                    model=request.model, version=version, alias=alias_name,
                    alias_issued_at=alias_at, builder_keyid=b.keyid,
                    trust_list_version=trust.version, request=request, build=dict(p))


def check_file(path: str | os.PathLike[str], verified: Verified) -> None:
    """The file holds exactly the attested bytes (size first: it costs nothing)."""
    from farm.node.cache import known_digest, note_hashed

    st = os.stat(path)
    if st.st_size != verified.size:
        raise _refuse(f"{path} is {st.st_size} bytes, the build statement says {verified.size}",
                      "size")
    if known_digest(st) == verified.digest:
        # This process hashed this very file (same inode, size and ctime) a
        # moment ago: the node cache did, on its way here.
        return
    digest = sha256_file(path)
    note_hashed(st, digest)
    if digest != verified.digest:
        raise _refuse(f"{path} hashes to sha256:{digest[:16]}, the build statement names "
                      f"sha256:{verified.digest[:16]}", "digest")


# --- what a node remembers ---------------------------------------------------------------


class TrustStore:
    """The newest trust list and alias statements this node accepted, on disk,
    so a farm (or a proxy) cannot roll it back to older ones after a restart."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _file(self, name: str) -> Path:
        return self.root / name

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)

    def _read(self, path: Path) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
        return {}

    def newest_trust_list(self, root_keyid: str) -> dict[str, Any] | None:
        env = self._read(self._file(f"trust-list-{root_keyid[:32]}.json")).get("envelope")
        return env if isinstance(env, dict) else None

    def accept_trust_list(self, fetched: attest.TrustList | None,
                          root_key: Any) -> attest.TrustList:
        """The newer of ``fetched`` and the stored list (stored: verified again)."""
        stored_env = self.newest_trust_list(fetched.root_keyid if fetched else
                                            attest.keyid(root_key))
        stored = None
        if stored_env is not None:
            try:
                stored = attest.verify_trust_list(stored_env, root_key)
            except attest.AttestationError as exc:
                log.warning("stored trust list no longer verifies: %s", exc)
        if fetched is None:
            if stored is None:
                raise _refuse("no trust list: the farm has none and this node kept none",
                              "trust_list")
            return stored
        if stored is not None and stored.version > fetched.version:
            log.warning("the farm served trust list version %d, older than version %d this "
                        "node has seen; keeping the newer one", fetched.version, stored.version)
            return stored
        if stored is None or fetched.version > stored.version:
            self._write(self._file(f"trust-list-{fetched.root_keyid[:32]}.json"),
                        {"envelope": fetched.envelope, "version": fetched.version})
        return fetched

    def _alias_file(self, farm: str) -> Path:
        return self._file(f"aliases-{hashlib.sha256(farm.encode()).hexdigest()[:16]}.json")

    def alias_seen(self, farm: str, model: str, alias: str) -> datetime | None:
        raw = self._read(self._alias_file(farm)).get(f"{model}@{alias}")
        if not isinstance(raw, str):
            return None
        try:
            return datetime.fromisoformat(raw)
        except ValueError:
            return None

    def remember_alias(self, farm: str, verified: Verified) -> None:
        if verified.alias is None or verified.alias_issued_at is None:
            return
        path = self._alias_file(farm)
        data = self._read(path)
        key = f"{verified.model}@{verified.alias}"
        old = self.alias_seen(farm, verified.model, verified.alias)
        if old is None or verified.alias_issued_at > old:
            data[key] = verified.alias_issued_at.isoformat()
            self._write(path, data)


# --- the file a node keeps beside an artifact ---------------------------------------------


def bundle_path(path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(path) + BUNDLE_SUFFIX)


def make_bundle(*, attestation: Mapping[str, Any], trust_list: attest.TrustList,
                request: NodeRequest, farm_url: str) -> dict[str, Any]:
    """Everything another node needs to check the file offline, given its own root key."""
    return {
        "bundleType": BUNDLE_TYPE,
        "build": attestation.get("build"), "version": attestation.get("version"),
        "alias": attestation.get("alias"), "trust_list": trust_list.envelope,
        "request": request.to_json(), "farm_url": farm_url,
    }


def read_bundle(path: str | os.PathLike[str]) -> dict[str, Any]:
    bpath = bundle_path(path)
    try:
        data = json.loads(bpath.read_text())
    except FileNotFoundError:
        raise _refuse(f"{path} has no attestation beside it ({bpath.name}): fetch it with "
                      "`farm fetch -o FILE`, which writes one", "attestation") from None
    except (OSError, ValueError) as exc:
        raise _refuse(f"{bpath}: {exc}", "attestation") from None
    if not isinstance(data, dict) or data.get("bundleType") != BUNDLE_TYPE:
        raise _refuse(f"{bpath} is not a torch-farm attestation bundle", "attestation")
    return data


def verify_file(
    path: str | os.PathLike[str],
    *,
    root_key: Any,
    node_target: Target,
    store: TrustStore | None = None,
    request: NodeRequest | None = None,
    formats: Sequence[str] | None = None,
) -> Verified:
    """Check a file and the bundle beside it on this node: the trust list by
    this node's root key (and not older than one it kept), the statements,
    the request the bundle records (or ``request``) with this node's own
    target, and the bytes."""
    data = read_bundle(path)
    try:
        tl = attest.verify_trust_list(data.get("trust_list"), root_key)
    except attest.AttestationError as exc:
        raise _refuse(str(exc), exc.field) from None
    if store is not None:
        tl = store.accept_trust_list(tl, root_key)
    if request is None:
        recorded = NodeRequest.from_json(data.get("request") or {})
        request = NodeRequest(model=recorded.model, ref=recorded.ref, inputs=recorded.inputs,
                              grad_mode=recorded.grad_mode, target=node_target,
                              options=recorded.options,
                              formats=tuple(formats) if formats else recorded.formats)
    seen = None
    if store is not None and request.ref is not None:
        seen = store.alias_seen(str(data.get("farm_url") or ""), request.model, request.ref)
    verified = verify_attestation(data, tl, request, alias_seen=seen)
    check_file(path, verified)
    return verified
