"""Name bindings, signed when the authenticated request that makes them is accepted.

``check_version`` runs before a submission is recorded, ``bind_version``
after; ``bind_alias`` before an alias moves. What they sign comes from the
request (the submitted spec, the alias asked for) and from statements this
API's own name key signed earlier, never from other database rows.
"""

from __future__ import annotations

import logging
from typing import Any

from farm.core import attest
from farm.core.attest import program_of_spec
from farm.core.specs import DEFAULT_PROJECT, JobSpec
from registry import service
from registry.db import Conflict
from registry.service import trust

from .state import AppState

log = logging.getLogger(__name__)


def _own_program(state: AppState, model: str, version: str) -> dict[str, Any] | None:
    """The program of ``model@version`` per the binding this key signed, if any."""
    stored = trust.get_binding(state.db, model, trust.VERSION, version)
    if stored is None:
        return None
    try:
        st = state.signer.read_own(stored[1], attest.VERSION_PREDICATE)
    except attest.AttestationError as exc:
        # Another (earlier) name key's, or a row someone wrote: not ours to vouch for.
        log.warning("stored binding of %s@%s does not verify under the name key: %s",
                    model, version, exc)
        return None
    if st.predicate.get("model") != model or st.predicate.get("version") != version:
        log.warning("stored binding of %s@%s names %s@%s", model, version,
                    st.predicate.get("model"), st.predicate.get("version"))
        return None
    program = st.predicate.get("program")
    return dict(program) if isinstance(program, dict) else None


def check_version(state: AppState, spec: JobSpec) -> None:
    """Refuse a submission that would rebind a version the name key already
    bound to another program (whatever the version's row now says)."""
    bound = _own_program(state, spec.name, spec.version)
    if bound is not None and bound != program_of_spec(spec):
        if service.version_rebind_blocker(state.db, spec.name, spec.version) is None:
            # Every build of it failed (a typo'd entrypoint, a bad kwarg): the
            # fix may take the name; bind_version signs the new program.
            return
        raise service.InvalidRequest(
            f"{spec.name}@{spec.version} already exists, bound to another program "
            f"({bound.get('entrypoint')}, code {bound.get('code_digest') or 'installed'}); "
            "submit a new version")


def bind_version(state: AppState, spec: JobSpec, *, submitted_by: str | None) -> None:
    program = program_of_spec(spec)
    if _own_program(state, spec.name, spec.version) == program:
        return
    envelope = state.signer.sign_version(model=spec.name, version=spec.version,
                                         program=program, submitted_by=submitted_by,
                                         project=spec.project or DEFAULT_PROJECT)
    try:
        trust.put_binding(state.db, model=spec.name, kind=trust.VERSION, ref=spec.version,
                          version=spec.version, envelope=envelope)
    except Conflict:
        # A concurrent submission of the same name@version bound it first: the
        # same program is that submission's binding, and ours is not needed.
        if _own_program(state, spec.name, spec.version) != program:
            raise


def bind_alias(state: AppState, model: str, alias: str, version: str, *,
               set_by: str | None, project: str | None = None) -> None:
    program = _own_program(state, model, version)
    if program is None:
        # An unknown version is a 404, not this.
        known = next((m["versions"] for m in service.list_models(state.db)
                      if m["name"] == model), None)
        if known is not None and version not in {v["version"] for v in known}:
            raise service.NotFound(f"no version {version!r} of model {model!r}; versions: "
                                   f"{', '.join(v['version'] for v in known) or 'none'}")
        raise service.InvalidRequest(
            f"{model}@{version} has no name binding signed by this farm's name key (made "
            "before attestation, or by another key): submit the version again to bind it, "
            "then set the alias")
    envelope = state.signer.sign_alias(model=model, alias=alias, version=version,
                                       program=program, set_by=set_by, project=project)
    try:
        trust.put_binding(state.db, model=model, kind=trust.ALIAS, ref=alias, version=version,
                          envelope=envelope)
    except Conflict:
        # Another request created the alias's row first; aliases move, so
        # this one replaces it (the row exists now and is updated).
        trust.put_binding(state.db, model=model, kind=trust.ALIAS, ref=alias, version=version,
                          envelope=envelope)
