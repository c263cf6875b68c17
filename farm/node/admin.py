"""The farm's API calls that are one request each: jobs, models and aliases,
tokens, fleet feedback (reports, coverage, policies, plans), deletions and
signing keys. The CLI's commands call these; ``FarmClient`` adds what a
fleet node does on top (submit with code, resolve, verify, fetch, load)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from farm.node.errors import NotFoundError
from farm.node.http import ApiSession
from farm.node.types import AliasList, Deleted, JobSummary, TokenInfo


class FarmAdmin(ApiSession):
    """One method per API call (see ``ApiSession`` for the connection)."""

    def health(self) -> dict[str, Any]:
        return dict(self._request("GET", "/healthz") or {})

    def job(self, job_id: str) -> dict[str, Any]:
        """A job with each target's build (``farm status``; a ``JobView``):
        state, the running build's stage, timings, errors, logs, artifacts.
        ``job_id`` may be a unique prefix of the id."""
        return dict(self._request("GET", f"/v1/jobs/{quote(str(job_id), safe='')}"))

    def models(self) -> list[dict[str, Any]]:
        """Every model with its versions (entrypoint, kwargs, artifact count) and
        aliases (``farm models``)."""
        body = self._request("GET", "/v1/models")
        return list(body.get("models", []) if isinstance(body, dict) else body)

    def model(self, name: str) -> dict[str, Any]:
        """One model: its versions, each with its artifacts, and its aliases
        (``farm artifacts``)."""
        return dict(self._request("GET", f"/v1/models/{quote(name, safe='')}"))

    def set_alias(self, model: str, alias: str, version: str) -> dict[str, Any]:
        """Point ``model@alias`` at ``version`` (``farm alias set``): promote, or
        roll back; the answer's ``previous`` is where it pointed before."""
        return dict(self._request(
            "PUT", f"/v1/models/{quote(model, safe='')}/aliases/{quote(alias, safe='')}",
            json={"version": version}))

    def create_token(self, name: str, role: str = "read",
                     projects: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A new API token (admin only); the answer holds the plaintext, shown once."""
        body: dict[str, Any] = {"name": name, "role": role}
        if projects is not None:
            body["projects"] = dict(projects)
        return dict(self._request("POST", "/v1/tokens", json=body))

    def projects(self) -> list[dict[str, Any]]:
        """Every project with its model count and who holds which role."""
        return list(self._request("GET", "/v1/projects").get("projects") or [])

    def create_project(self, name: str, *, owner: str | None = None) -> dict[str, Any]:
        """A new project (an admin token); ``owner``: a token name made its owner."""
        body: dict[str, Any] = {"name": name}
        if owner:
            body["owner"] = owner
        return dict(self._request("POST", "/v1/projects", json=body))

    def grant(self, project: str, principal: str, role: str) -> dict[str, Any]:
        """Give the token name ``principal`` ``role`` in ``project`` (its owner, or an admin)."""
        return dict(self._request(
            "PUT", f"/v1/projects/{quote(project, safe='')}/roles/{quote(principal, safe='')}",
            json={"role": role}))

    def revoke_role(self, project: str, principal: str) -> dict[str, Any]:
        """Take ``principal``'s role in ``project`` away."""
        return dict(self._request(
            "DELETE", f"/v1/projects/{quote(project, safe='')}/roles/{quote(principal, safe='')}"))

    def new_cache_salt(self, target: str) -> dict[str, Any]:
        """A new salt for ``target``'s shared compile cache (admin): disowns its entries."""
        return dict(self._request("POST", "/v1/cache/salt", json={"target": target}))

    def targets(self) -> Any:
        """Targets with live compile workers (``farm targets``)."""
        return self._request("GET", "/v1/targets")

    def ready(self) -> dict[str, Any]:
        """``/readyz``: whether the farm can take a job now (a compile worker is
        live); ``FarmUnavailable`` naming what is missing when it cannot."""
        return dict(self._request("GET", "/readyz") or {})

    # --- fleet feedback: reports, coverage, policies, plans --------------------

    def misses(self, model: str | None = None, *, since_s: float | None = None,
               limit: int = 100) -> dict[str, Any]:
        """What nodes did not get, grouped and counted (``farm misses``)."""
        params: dict[str, Any] = {"limit": limit}
        if model:
            params["model"] = model
        if since_s:
            params["since_s"] = since_s
        return dict(self._request("GET", "/v1/misses", params=params))

    def model_reports(self, model: str, *, since_s: float | None = None) -> dict[str, Any]:
        """Reports of ``model`` by kind, and its most frequent misses."""
        params = {"since_s": since_s} if since_s else {}
        return dict(self._request("GET", f"/v1/models/{quote(model, safe='')}/reports",
                                  params=params))

    def coverage(self, model: str, version: str | None = None) -> dict[str, Any]:
        """``farm coverage MODEL[@VERSION]``: what each version serves, and what
        nodes asked for that nothing serves."""
        params = {"version": version} if version else {}
        return dict(self._request("GET", f"/v1/models/{quote(model, safe='')}/coverage",
                                  params=params))

    def policy(self, model: str) -> dict[str, Any]:
        """The model's fleet policy (``farm policy show``)."""
        return dict(self._request("GET", f"/v1/models/{quote(model, safe='')}/policy"))

    def set_policy(self, model: str, *, build_on_miss: bool | None = None,
                   min_interval_s: float | None = None) -> dict[str, Any]:
        """``farm policy set``: build on miss on or off, and how often."""
        body: dict[str, Any] = {}
        if build_on_miss is not None:
            body["build_on_miss"] = build_on_miss
        if min_interval_s is not None:
            body["min_interval_s"] = min_interval_s
        return dict(self._request("PUT", f"/v1/models/{quote(model, safe='')}/policy",
                                  json=body))

    def plan(self, target: str, *, submit: bool = False,
             since_s: float | None = None) -> dict[str, Any]:
        """``farm plan --target``: the builds every model and alias the fleet
        uses needs on ``target``; with ``submit``, submitted."""
        if submit:
            body: dict[str, Any] = {"target": target}
            if since_s:
                body["since_s"] = since_s
            return dict(self._request("POST", "/v1/plan", json=body))
        params: dict[str, Any] = {"target": target}
        if since_s:
            params["since_s"] = since_s
        return dict(self._request("GET", "/v1/plan", params=params))

    # --- everyday commands: the CLI's, one method each --------------------------

    def jobs(self, *, state: str | None = None, model: str | None = None,
             limit: int = 50) -> list[JobSummary]:
        """Jobs, newest first (``farm jobs``); filter by ``state`` (queued,
        tracing, compiling, succeeded, failed, partial) or ``model``."""
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        if model:
            params["model"] = model
        body = self._request("GET", "/v1/jobs", params=params)
        return list(body.get("jobs", []))

    def aliases(self, model: str, *, history: bool = True) -> AliasList:
        """The model's aliases and (``history``) every move of each, newest first
        (``farm alias list``): what a rollback reads."""
        body: AliasList = self._request("GET", f"/v1/models/{quote(model, safe='')}/aliases",
                                        params={"history": str(history).lower()})
        return body

    def delete_alias(self, model: str, alias: str) -> Deleted:
        """Remove ``model@alias`` (its history is kept)."""
        body: Deleted = self._request(
            "DELETE", f"/v1/models/{quote(model, safe='')}/aliases/{quote(alias, safe='')}")
        return body

    def delete_version(self, model: str, version: str, *, force: bool = False) -> Deleted:
        """Delete ``model@version``: its jobs, the aliases on it, and the artifacts
        no other version uses. ``force``: even while its jobs still build."""
        body: Deleted = self._request(
            "DELETE", f"/v1/models/{quote(model, safe='')}/versions/{quote(version, safe='')}",
            params={"force": str(force).lower()})
        return body

    def delete_model(self, model: str, *, force: bool = False) -> Deleted:
        """Delete a model with all its versions (admin)."""
        body: Deleted = self._request("DELETE", f"/v1/models/{quote(model, safe='')}",
                                      params={"force": str(force).lower()})
        return body

    def delete_artifact(self, digest: str) -> Deleted:
        """Delete an artifact by its sha256 (admin): nodes stop resolving to it."""
        body: Deleted = self._request("DELETE", f"/v1/artifacts/{quote(digest, safe='')}")
        return body

    def tokens(self, *, revoked: bool = False) -> list[TokenInfo]:
        """API tokens by name and role (admin); the tokens themselves are never kept."""
        body = self._request("GET", "/v1/tokens", params={"revoked": str(revoked).lower()})
        return list(body.get("tokens", []))

    def revoke_token(self, name: str) -> int:
        """Revoke every token named ``name`` (admin); returns how many."""
        body = self._request("DELETE", f"/v1/tokens/{quote(name, safe='')}")
        return int(body.get("revoked", 0))

    # --- signing keys (admin) ----------------------------------------------------

    def keys(self) -> dict[str, Any]:
        """Enrolled signing keys, and the API's name key."""
        return dict(self._request("GET", "/v1/keys"))

    def enroll_key(self, name: str, role: str, public_key: str) -> dict[str, Any]:
        """Enrol a builder's (or the API's name) public key (admin)."""
        return dict(self._request("POST", "/v1/keys", json={
            "name": name, "role": role, "public_key": public_key}))

    def revoke_key(self, keyid: str, *, reason: str = "") -> dict[str, Any]:
        return dict(self._request("POST", f"/v1/keys/{quote(keyid, safe='')}/revoke",
                                  json={"reason": reason}))

    def trust_list_version(self) -> int | None:
        """The version of the trust list the farm serves now (unverified: for
        numbering the next one), or None when it has none."""
        from farm.core import attest

        try:
            body = self._request("GET", "/v1/trust-list")
        except NotFoundError:
            return None
        _, payload, _ = attest.parse_envelope(body)
        version = attest.payload_json(payload).get("version")
        return int(version) if isinstance(version, int) else None
