"""The farm's HTTP API as a Python object: submit and watch jobs, resolve,
download (attestations and digest checked) and load artifacts.

Trust (docs/security.md). Loading an artifact unpickles or dlopens it, which
runs code. Before any byte is loaded the client checks, with
``farm.node.verify``: the trust list against the root key this node pins;
the build statement (signed by an enrolled, unrevoked builder key) and the
version and alias statements (signed by the farm's name key) against its
own request, field by field; and the bytes against the attested digest.

The root key comes from the ``root_key`` argument or ``FARM_ROOT_KEY`` (PEM
text or a path). Only for a farm on a loopback address (the embedded
default) is it fetched and trusted on first use, with a warning, and pinned
per farm URL under the cache directory. Plain ``http://`` to any other host
is refused unless ``FARM_ALLOW_HTTP`` (or ``allow_http=True``) says otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urljoin, urlsplit

import httpx
import tenacity

from farm.core.specs import (
    CompileOptions,
    GradMode,
    JobSpec,
    SpecError,
    TensorSpec,
    canonical_inputs,
    parse_inputs,
)
from farm.core.target import Target
from farm.node.cache import ArtifactCache, CacheCorrupt, CacheError, validate_digest
from farm.node.errors import (
    AuthenticationError,
    FarmError,
    FarmUnavailable,
    IntegrityError,
    JobTimeout,
    NotFoundError,
    _detail_text,
)
from farm.node.reports import Report, Reporter
from farm.node.types import AliasList, Deleted, JobSummary, TokenInfo

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from farm.core.attest import TrustList
    from farm.node.verify import NodeRequest, TrustStore, Verified

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "partial"})
# How long a fetched trust list is used before asking again: a revocation
# reaches every node within this (once the admin has signed the new list).
TRUST_LIST_TTL_S = 30.0
# The key the client keeps its own request under in a resolve answer
# (always overwritten: the farm's answer never supplies it).
NODE_REQUEST = "node_request"
_CHUNK = 1 << 20
_MAX_REDIRECTS = 5
_RETRY_STATUSES = frozenset({502, 503, 504})


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def is_loopback(url: str) -> bool:
    import ipaddress

    host = (urlsplit(url).hostname or "").strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def as_grad_mode(value: GradMode | str | bool | None) -> GradMode:
    """``None`` means the current torch grad mode; ``True`` means training."""
    if isinstance(value, GradMode):
        return value
    if value is None:
        import torch

        return GradMode.TRAINING if torch.is_grad_enabled() else GradMode.INFERENCE
    if isinstance(value, bool):
        return GradMode.TRAINING if value else GradMode.INFERENCE
    try:
        return GradMode(value)
    except ValueError:
        raise SpecError(f"unknown grad_mode {value!r}; known: inference, training") from None


def as_input_specs(inputs: Any) -> tuple[TensorSpec, ...]:
    """Input specs from spec strings, ``TensorSpec``s or example tensors (static
    shapes); a mapping names them: ``{"input_ids": ids, "batch": {"x": x}}``
    is ``input_ids=...`` and ``batch.x=...`` (keyword and dict inputs)."""
    if inputs is None:
        raise SpecError("input specs are needed to resolve an artifact")
    if isinstance(inputs, str):
        return parse_inputs(p for p in inputs.split(";") if p)
    if isinstance(inputs, Mapping):
        named = []
        for path, item in _named_items(inputs, ""):
            (spec,) = as_input_specs([item])
            named.append(dataclasses.replace(spec, name=path))
        return canonical_inputs(named)
    out = []
    for item in inputs:
        if isinstance(item, TensorSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(TensorSpec.parse(item))
        elif hasattr(item, "shape") and hasattr(item, "dtype"):
            dtype = str(item.dtype).removeprefix("torch.")
            out.append(TensorSpec.parse(f"{dtype}[{','.join(str(int(d)) for d in item.shape)}]"))
        else:
            raise SpecError(f"cannot make an input spec of {type(item).__name__}: give a spec "
                            "string like 'float32[8,64]' or an example tensor")
    if not out:
        raise SpecError("at least one input spec is needed")
    return canonical_inputs(out)


def _named_items(mapping: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """(dotted path, leaf) of a nested mapping of example tensors or specs."""
    out: list[tuple[str, Any]] = []
    for key, item in mapping.items():
        path = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out += _named_items(item, path + ".")
        else:
            out.append((path, item))
    return out


def as_target(target: Target | str | None, device: str | None = None) -> Target:
    if isinstance(target, Target):
        return target
    if target is None or target == "auto":
        # A node: what it can run depends on its CPU, not on a compiler; kept
        # per machine so that a CLI call need not import torch for it.
        from farm.node.local_target import node_target

        return node_target(device)
    return Target.parse(target)


# --- the client ----------------------------------------------------------------


class FarmClient:
    """The farm's HTTP API, a verified download path and a local cache.

    ``url`` and ``token`` default to ``FARM_URL`` and ``FARM_TOKEN``; ``cache``
    to an ``ArtifactCache`` at ``CLIENT_CACHE_DIR`` bounded by
    ``CLIENT_CACHE_MAX_BYTES``. Safe to share between threads. ``reports``
    (default ``FARM_REPORTS``): send node reports (``report``) in the background.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        root_key: Any = None,
        public_key: Any = None,
        cache: ArtifactCache | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        require_signature: bool = True,
        allow_http: bool | None = None,
        transport: httpx.BaseTransport | None = None,
        reports: bool | None = None,
    ) -> None:
        from farm.core.settings import get_settings

        settings = get_settings()
        self.url = (url or settings.farm_url).rstrip("/")
        allow = settings.farm_allow_http if allow_http is None else allow_http
        if urlsplit(self.url).scheme.lower() == "http" and not is_loopback(self.url) and not allow:
            # Tokens and answers in clear text, to any host on the path.
            raise FarmError(f"refusing plain http to {urlsplit(self.url).hostname}: use https "
                            "(docs/security.md, TLS), or set FARM_ALLOW_HTTP=1 on a network "
                            "you trust")
        self.token = settings.farm_token if token is None else token
        # ``public_key`` is the older name of the same argument: the key the
        # farm's chain of trust starts from.
        source = root_key if root_key is not None else public_key
        self._public_key_source = source if source is not None else (
            settings.farm_root_key or None)
        self._public_key: Ed25519PublicKey | None = None
        self._key_lock = threading.Lock()
        self._trust: tuple[float, TrustList] | None = None
        self._trust_lock = threading.Lock()
        self._cache = cache
        self._cache_lock = threading.Lock()
        self._reporter: Reporter | None = None
        self._reports_on = settings.farm_reports if reports is None else reports
        self._report_interval_s = settings.farm_report_interval_s
        self.retries = retries
        self.require_signature = require_signature
        t = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        headers = {"User-Agent": "torch-farm-client"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        verify: Any = True
        if settings.farm_ca_bundle:
            import ssl

            # A private CA (docs/security.md, TLS); the system's CAs otherwise.
            verify = ssl.create_default_context(cafile=settings.farm_ca_bundle)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=t,
                                  follow_redirects=False, transport=transport, verify=verify)
        # For presigned URLs on another origin: never carries the farm token.
        self._bare = httpx.Client(timeout=t, follow_redirects=False, transport=transport,
                                  headers={"User-Agent": "torch-farm-client"}, verify=verify)

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()
        self._http.close()
        self._bare.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FarmClient({self.url!r})"

    @property
    def cache(self) -> ArtifactCache:
        with self._cache_lock:
            if self._cache is None:
                self._cache = ArtifactCache.from_settings()
            return self._cache

    # --- HTTP ---------------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        """JSON of a successful answer; a ``FarmError`` subclass otherwise.
        GETs are retried (tenacity) on connection errors and 502/503/504,
        honouring a Retry-After of up to 5 s; other methods are sent once."""
        attempts = 1 + (self.retries if method == "GET" else 0)
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=_backoff,
            retry=(tenacity.retry_if_exception_type(httpx.TransportError)
                   | tenacity.retry_if_result(lambda r: r.status_code in _RETRY_STATUSES)),
            # Out of attempts: the last answer (a 503 is reported as such below)
            # or the last connection error, not tenacity's RetryError.
            retry_error_callback=lambda state: state.outcome.result(),  # type: ignore[union-attr]
        )
        try:
            r = retrying(self._http.request, method, path, **kw)
        except httpx.TransportError as exc:
            raise FarmUnavailable(
                f"cannot reach the farm at {self.url}: {exc or type(exc).__name__}"
            ) from None
        self._raise_for(r, f"{method} {path}")
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise FarmError(f"{method} {path}: the farm answered {r.status_code} with "
                            "something that is not JSON", status=r.status_code) from None

    def _raise_for(self, r: httpx.Response, what: str) -> None:
        if r.status_code < 400:
            return
        body: Any = None
        with contextlib.suppress(ValueError):
            body = r.json()
        detail = body.get("detail") if isinstance(body, dict) else None
        text = _detail_text(detail) if detail is not None else (
            r.text.strip().splitlines()[0][:300] if r.text.strip() else r.reason_phrase)
        status = r.status_code
        if status == 404:
            rejections = body.get("rejections", []) if isinstance(body, dict) else []
            raise NotFoundError(text, detail=body, rejections=rejections or [])
        if status in (401, 403):
            raise AuthenticationError(f"{text} (HTTP {status})", status=status, detail=body)
        if status >= 500:
            raise FarmUnavailable(f"farm error on {what}: {text} (HTTP {status})",
                                  status=status, detail=body)
        raise FarmError(f"{text} (HTTP {status})", status=status, detail=body)

    # --- the API -------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return dict(self._request("GET", "/healthz") or {})

    def submit(self, spec: JobSpec | Mapping[str, Any], *,
               source: str | os.PathLike[str] | bool | None = None,
               wheels: Sequence[str | os.PathLike[str]] = (),
               requirements: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Submit a job, with its model's code.

        ``source``: the file or directory to ship (``farm.core.codepack``);
        None: the entrypoint module's own file or package, found on disk
        without importing it, unless it is installed or one of ``wheels``
        provides it (then no source is shipped: the wheel, or the farm's
        workers' own installation, has it); False: ship no source.
        ``wheels`` (the user's own ``.whl`` files) and ``requirements`` (a
        file of ``name==version`` pins, optionally ``--hash``ed) travel in the
        same pack; the workers install them with ``pip --no-deps``, so their
        dependencies must be among them too. The pack is uploaded only when
        the farm lacks it; the answer's ``code`` says what went (None when
        nothing did).
        """
        from dataclasses import replace

        from farm.core.codepack import plan_source
        from farm.core.wheels import top_levels_of

        if not isinstance(spec, JobSpec):
            spec = JobSpec.from_json(spec)
        code: dict[str, Any] | None = None
        if spec.code_digest is None:
            where: Path | None = None
            if source not in (None, True, False):
                where = Path(source)  # type: ignore[arg-type]
            elif source is not False:
                top = spec.model.entrypoint.partition(":")[0].split(".")[0]
                provided = set().union(*(top_levels_of(w) for w in wheels))
                if top not in provided:
                    where = plan_source(spec.model.entrypoint).source
            if where is not None or wheels or requirements is not None:
                code = self.upload_code(where, wheels=wheels, requirements=requirements)
                spec = replace(spec, code_digest=code["digest"])
        out = dict(self._request("POST", "/v1/jobs", json=spec.to_json()))
        out["code"] = code
        return out

    def upload_code(self, source: str | os.PathLike[str] | None, *,
                    wheels: Sequence[str | os.PathLike[str]] = (),
                    requirements: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Pack ``source`` (None: none) with ``wheels`` and ``requirements``
        reproducibly and upload it unless the farm has that digest already;
        returns digest, size, files, source and uploaded."""
        from farm.core.codepack import pack
        from farm.core.settings import get_settings

        p = pack(source, max_bytes=get_settings().code_pack_max_bytes, wheels=wheels,
                 requirements=requirements)
        path = f"/v1/code/{p.digest}"
        try:
            self._request("HEAD", path)
            uploaded = False
        except NotFoundError:
            self._request("PUT", path, content=p.data,
                          headers={"Content-Type": "application/x-tar"})
            uploaded = True
        shipped = [str(x) for x in (source, *wheels, requirements) if x is not None]
        return {"digest": p.digest, "size": p.size, "files": len(p.files),
                "source": ", ".join(shipped), "uploaded": uploaded}

    def job(self, job_id: str) -> dict[str, Any]:
        """A job with each target's build (``farm status``; a ``JobView``):
        state, the running build's stage, timings, errors, logs, artifacts.
        ``job_id`` may be a unique prefix of the id."""
        return dict(self._request("GET", f"/v1/jobs/{quote(str(job_id), safe='')}"))

    def wait(
        self,
        job_id: str,
        timeout: float | None = None,
        *,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 1.0,
    ) -> dict[str, Any]:
        """Poll until the job is succeeded, failed or partial; returns its last view.

        ``on_progress`` is called with every view polled (the first one too).
        Raises ``JobTimeout`` after ``timeout`` seconds (None: wait forever).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(0.25, poll_s)
        while True:
            view = self.job(job_id)
            if on_progress is not None:
                on_progress(view)
            if view.get("state") in TERMINAL_JOB_STATES:
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(
                    f"job {view.get('id', job_id)} still {view.get('state')} after "
                    f"{timeout:g} s; it goes on on the farm: `farm status "
                    f"{view.get('id', job_id)} --wait` (or wait() again) picks it up", detail=view)
            pause = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)
            delay = min(poll_s, delay * 2)

    def models(self) -> list[dict[str, Any]]:
        """Every model with its versions (entrypoint, kwargs, artifact count) and
        aliases (``farm models``)."""
        body = self._request("GET", "/v1/models")
        return list(body.get("models", []) if isinstance(body, dict) else body)

    def set_alias(self, model: str, alias: str, version: str) -> dict[str, Any]:
        """Point ``model@alias`` at ``version`` (``farm alias set``): promote, or
        roll back; the answer's ``previous`` is where it pointed before."""
        return dict(self._request(
            "PUT", f"/v1/models/{quote(model, safe='')}/aliases/{quote(alias, safe='')}",
            json={"version": version}))

    def create_token(self, name: str, role: str) -> dict[str, Any]:
        """A new API token (admin only); the answer holds the plaintext, shown once."""
        return dict(self._request("POST", "/v1/tokens", json={"name": name, "role": role}))

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

    def compiled(self, module_or_fn: Any, *, model: str, ref: str | None = None,
                 example_inputs: Any = None, **kw: Any) -> Callable[..., Any]:
        """``farm.node.compiled`` through this client: ``module_or_fn`` on the
        farm's artifact, or JIT with the reason (see that function)."""
        from farm.node.compiled import compiled

        return compiled(module_or_fn, model=model, ref=ref, example_inputs=example_inputs,
                        client=self, **kw)

    def resolve(
        self,
        model: str,
        ref: str | None = None,
        inputs: Any = None,
        grad_mode: GradMode | str | bool | None = GradMode.INFERENCE,
        target: Target | str | None = "auto",
        *,
        formats: Sequence[str] | None = None,
        options: Mapping[str, Any] | None = None,
        offline: bool = False,
        layout: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> dict[str, Any]:
        """The farm's best artifact for this node (``farm resolve``), with
        ``why`` it was chosen; ``NotFoundError`` (with each candidate's
        rejection reason) when none fits.

        Every answer is kept in this node's cache. With ``offline``, when the
        farm cannot be reached, the answer kept for the very same question is
        returned instead (``offline: True``, ``resolved_at``); ``fetch`` then
        checks its signature and digest as always and finds the bytes in the
        cache (``farm prefetch`` puts them there).

        ``layout`` (``MeshLayout.to_json()``: world_size, mesh_shape,
        mesh_dim_names) and ``rank``: this process's place in a tensor-parallel
        group; only an artifact built for that layout is answered."""
        import json

        from farm.core.elf import process_libstdcxx
        from farm.node.verify import NodeRequest

        specs = as_input_specs(inputs)
        node, mode = as_target(target), as_grad_mode(grad_mode)
        # What fetch() checks the attestations against: this node's own
        # question, never anything the answer says.
        own = NodeRequest(model=model, ref=ref or None, inputs=specs, grad_mode=mode,
                          target=node,
                          options=CompileOptions.from_json(options) if options else None,
                          formats=tuple(formats) if formats else None).to_json()
        params: list[tuple[str, str]] = [("model", model),
                                         ("target", str(node)),
                                         ("grad_mode", mode.value)]
        params += [("input", str(s)) for s in specs]
        if ref:
            params.append(("ref", ref))
        for f in formats or ():
            params.append(("format", f))
        if options:
            params.append(("options", json.dumps(dict(options), sort_keys=True)))
        if layout is not None:
            from farm.core.specs import MeshLayout

            params.append(("layout", json.dumps(MeshLayout.from_json(layout).to_json(),
                                                sort_keys=True)))
        if rank is not None:
            params.append(("rank", str(rank)))
        # What this node's libstdc++ provides: the farm refuses an AOTI
        # package whose library needs a symbol version it lacks.
        provides = process_libstdcxx()
        if provides:
            params.append(("libstdcxx", ",".join(provides)))
        try:
            answer = dict(self._request("GET", "/v1/resolve", params=params))
        except FarmUnavailable:
            kept = self._kept_resolution(params) if offline else None
            if kept is None:
                raise
            log.warning("torch-farm: the farm at %s cannot be reached; using the answer this "
                        "node kept at %s for %s@%s", self.url, kept.get("resolved_at"), model,
                        ref or "latest")
            return {**kept, NODE_REQUEST: own}
        answer[NODE_REQUEST] = own
        self._keep_resolution(params, answer)
        return answer

    def _resolution_path(self, params: Sequence[tuple[str, str]]) -> Path:
        key = "\n".join([self.url, *sorted(f"{k}={v}" for k, v in params)])
        name = hashlib.sha256(key.encode()).hexdigest()
        return self.cache.root / "resolutions" / f"{name}.json"

    def _keep_resolution(self, params: Sequence[tuple[str, str]], answer: Mapping[str, Any]
                         ) -> None:
        """Best effort: a node that cannot write its cache still resolves."""
        import json
        from datetime import datetime, timezone

        try:
            path = self._resolution_path(params)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({**answer, "resolved_at":
                                       datetime.now(timezone.utc).isoformat()}))
            os.replace(tmp, path)
        except (OSError, CacheError, TypeError, ValueError) as exc:
            log.debug("could not keep the resolve answer: %s", exc)

    def _kept_resolution(self, params: Sequence[tuple[str, str]]) -> dict[str, Any] | None:
        import json

        try:
            kept = json.loads(self._resolution_path(params).read_text())
        except (OSError, ValueError, CacheError):
            return None
        if not isinstance(kept, dict) or not isinstance(kept.get("artifact"), dict):
            return None
        # Trusted no more than a fresh answer: fetch() checks its signature
        # against the pinned key and its bytes against the digest.
        return {**kept, "offline": True}

    @property
    def reporter(self) -> Reporter | None:
        """The background sender of this client's node reports (None with
        ``FARM_REPORTS=0``); started on the first report."""
        with self._cache_lock:
            if self._reporter is None and self._reports_on:
                self._reporter = Reporter(self._http, interval_s=self._report_interval_s)
            return self._reporter

    def report(self, kind: str, *, model: str, ref: str | None, inputs: Any,
               grad_mode: GradMode | str | bool | None, target: Target | str,
               version: str | None = None, format: str | None = None,
               digest: str | None = None, code: str | None = None,
               reason: str | None = None, seconds: float | None = None) -> None:
        """Queue a node report (a ``miss``, ``guard_failure``, ``fallback`` or
        ``load``) for the background sender: returns at once, never raises."""
        try:
            reporter = self.reporter
            if reporter is None:
                return
            reporter.add(Report(
                kind=kind, model=model, ref=ref or None, version=version,
                inputs=[str(s) for s in as_input_specs(inputs)],
                grad_mode=as_grad_mode(grad_mode).value, target=str(as_target(target)),
                format=format, digest=digest, code=(code or None) and code[:32],
                reason=reason, seconds=seconds))
        except Exception as exc:  # telemetry must never break a node
            log.debug("could not queue a %s report: %s", kind, exc)

    def report_miss(
        self,
        model: str,
        ref: str | None,
        inputs: Any,
        grad_mode: GradMode | str | bool | None,
        target: Target | str,
        reasons: Sequence[Any],
    ) -> None:
        """Tell the farm this node did not use its artifact and fell back to
        JIT (queued as a ``fallback`` report: never waits, never raises)."""
        first = next((r for r in reasons if isinstance(r, Mapping)), {})
        self.report("fallback", model=model, ref=ref, inputs=inputs, grad_mode=grad_mode,
                    target=target, digest=first.get("digest"), code=first.get("code"),
                    reason=first.get("reason") or (str(reasons[0]) if reasons else None))

    # --- trust -------------------------------------------------------------------

    def public_key(self) -> Ed25519PublicKey:
        """The root key the trust list must be signed with (see the module docstring)."""
        from farm.core.signing import SigningKeyError, load_public_key

        with self._key_lock:
            if self._public_key is not None:
                return self._public_key
            try:
                if self._public_key_source is not None:
                    key = load_public_key(self._public_key_source)
                else:
                    key = self._pinned_key()
            except SigningKeyError as exc:
                raise IntegrityError(f"farm root key: {exc}") from None
            self._public_key = key
            return key

    def _pin_path(self) -> Path:
        name = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return self.cache.root / "trusted-keys" / f"{name}.root.pem"

    def _pinned_key(self) -> Ed25519PublicKey:
        from farm.core.signing import key_id, load_public_key, public_key_pem

        pin = self._pin_path()
        if pin.exists():
            return load_public_key(pin)
        if not is_loopback(self.url):
            # Trust on first use over a network is trusting whoever answers first.
            raise IntegrityError(
                f"no root key configured for {self.url}: set FARM_ROOT_KEY to the farm's root "
                "public key (`farm keys generate-root` wrote it); trust on first use is only "
                "for a farm on this machine")
        try:
            r = self._http.get("/v1/root-key")
        except httpx.TransportError as exc:
            raise FarmUnavailable(f"cannot reach the farm at {self.url} for its root key: "
                                  f"{exc or type(exc).__name__}") from None
        self._raise_for(r, "GET /v1/root-key")
        key = load_public_key(r.text)
        pin.parent.mkdir(parents=True, exist_ok=True)
        tmp = pin.with_name(f".{pin.name}.{os.getpid()}.tmp")
        tmp.write_text(public_key_pem(key))
        with contextlib.suppress(FileExistsError):
            # First writer wins; everyone then trusts what is on disk.
            os.link(tmp, pin)
        tmp.unlink()
        log.warning("trusting the root key %s of the local farm %s on first use (pinned in %s); "
                    "set FARM_ROOT_KEY to configure it instead", key_id(key), self.url, pin)
        return load_public_key(pin)

    def trust_store(self) -> TrustStore:
        from farm.node.verify import TrustStore

        return TrustStore(self.cache.root / "trust")

    def trust_list(self, *, refresh: bool = False) -> TrustList:
        """The farm's trust list, verified by the root key; never older than
        one this node accepted before (kept under the cache directory)."""
        from farm.core import attest
        from farm.node.verify import AttestationRefused

        with self._trust_lock:
            now = time.monotonic()
            if self._trust is not None and not refresh and now - self._trust[0] < TRUST_LIST_TTL_S:
                return self._trust[1]
            root = self.public_key()
            fetched = None
            try:
                body = self._request("GET", "/v1/trust-list")
            except NotFoundError:
                body = None
            except FarmUnavailable as exc:
                # Offline (a node running what it prefetched): the newest list
                # this node accepted before, verified again; none, and it refuses.
                log.warning("torch-farm: cannot fetch the trust list (%s); using the one this "
                            "node kept", exc)
                body = None
            if body is not None:
                try:
                    fetched = attest.verify_trust_list(body, root)
                except attest.AttestationError as exc:
                    raise AttestationRefused(str(exc), field=exc.field) from None
            tl = self.trust_store().accept_trust_list(fetched, root)
            self._trust = (now, tl)
            return tl

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

    def put_trust_list(self, envelope: Mapping[str, Any]) -> dict[str, Any]:
        """Upload a trust list the admin signed offline (admin)."""
        with self._trust_lock:
            self._trust = None
        return dict(self._request("PUT", "/v1/trust-list", json=dict(envelope)))

    def verify_signature(self, resolved: Mapping[str, Any], *,
                         request: NodeRequest | None = None) -> Verified:
        """Check the attestations of a resolve answer against this node's
        request; returns what verified, or raises ``AttestationRefused`` (an
        ``IntegrityError``) naming the field. Needs no bytes: call it before
        downloading."""
        from farm.node.verify import AttestationRefused, NodeRequest, verify_attestation

        artifact = resolved.get("artifact", resolved)
        if not isinstance(artifact, Mapping):
            raise FarmError("verify needs a resolve answer or its 'artifact'")
        if request is None:
            raw = resolved.get(NODE_REQUEST)
            if not isinstance(raw, Mapping):
                raise FarmError("verify needs the node's own request: pass the answer of "
                                "FarmClient.resolve, or request=NodeRequest(...)")
            request = NodeRequest.from_json(raw)
        bundle = artifact.get("attestation")
        if not isinstance(bundle, Mapping):
            raise AttestationRefused(f"artifact {str(artifact.get('digest'))[:12]} carries no "
                                     "attestation", field="attestation")
        seen = None
        if request.ref is not None:
            seen = self.trust_store().alias_seen(self.url, request.model, request.ref)
        claimed = {**artifact, "version": resolved.get("version", artifact.get("version"))}
        return verify_attestation(bundle, self.trust_list(), request, claimed=claimed,
                                  alias_seen=seen)

    # --- download ---------------------------------------------------------------

    def _blob_chunks(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes from the API, following a redirect to presigned
        storage without the farm token (a generator: nothing is requested
        until it is iterated)."""
        url = f"{self.url}/v1/artifacts/{digest}/blob"
        api = _origin(self.url)
        for _ in range(_MAX_REDIRECTS + 1):
            client = self._http if _origin(url) == api else self._bare
            try:
                with client.stream("GET", url) as r:
                    if r.is_redirect:
                        location = r.headers.get("location")
                        if not location:
                            raise FarmError(f"download of {digest[:12]}: redirect without Location")
                        url = urljoin(url, location)
                        continue
                    if r.status_code >= 400:
                        r.read()
                        self._raise_for(r, f"GET blob {digest[:12]}")
                    yield from r.iter_bytes(_CHUNK)
                    return
            except httpx.TransportError as exc:
                raise FarmUnavailable(f"download of {digest[:12]} from "
                                      f"{urlsplit(url).netloc} failed: {exc}") from None
        raise FarmError(f"download of {digest[:12]}: more than {_MAX_REDIRECTS} redirects")

    def fetch_verified(self, resolved: Mapping[str, Any], *,
                       request: NodeRequest | None = None) -> tuple[Path, Verified | None]:
        """Verify the attestations, then download into the cache (or find it
        there) checking the attested sha256 and size. Nothing is unpickled.
        ``Verified`` is None only with ``require_signature=False`` and an
        artifact that carries no attestation at all."""
        from farm.node.verify import AttestationRefused

        artifact = resolved.get("artifact", resolved)
        if not isinstance(artifact, Mapping):
            raise FarmError("fetch needs a resolve answer or its 'artifact'")
        verified: Verified | None
        try:
            verified = self.verify_signature(resolved, request=request)
        except AttestationRefused as exc:
            if self.require_signature or exc.field != "attestation":
                raise
            log.warning("%s (require_signature=False: fetching it anyway)", exc)
            verified = None
        size: int | None
        if verified is not None:
            digest, size = verified.digest, verified.size
        else:
            try:
                digest = validate_digest(artifact.get("digest"))
            except CacheError as exc:
                raise IntegrityError(f"the farm named an artifact by a bad digest: {exc}") from None
            raw_size = artifact.get("size")
            size = raw_size if isinstance(raw_size, int) else None
        path = self.cache.get(digest, size=size)
        if path is None:
            try:
                path = self.cache.put_stream(digest, self._blob_chunks(digest), size=size)
            except CacheCorrupt as exc:
                raise IntegrityError(str(exc)) from None
            except CacheError as exc:
                raise FarmError(f"cache: {exc}") from None
        if verified is not None:
            # An alias statement counts as seen once its bytes are here.
            self.trust_store().remember_alias(self.url, verified)
        return path, verified

    def fetch(self, resolved: Mapping[str, Any], *, request: NodeRequest | None = None) -> Path:
        """``fetch_verified``'s path."""
        return self.fetch_verified(resolved, request=request)[0]

    def bundle(self, resolved: Mapping[str, Any], verified: Verified) -> dict[str, Any]:
        """The attestation bundle to keep beside a copy of the file (``farm fetch -o``)."""
        from farm.node.verify import make_bundle

        artifact = resolved.get("artifact", resolved)
        return make_bundle(attestation=artifact["attestation"], trust_list=self.trust_list(),
                           request=verified.request, farm_url=self.url)

    def load(self, resolved: Mapping[str, Any], *, module: Any = None,
             external_data: Mapping[str, Any] | None = None,
             mesh: Any = None) -> Callable[..., Any]:
        """Fetch and verify (see ``fetch_verified``), then load the artifact.
        ``external_data``: this node's objects for a function artifact that
        captures them, by the names its job declared. ``mesh``: this rank's
        DeviceMesh, for a tensor-parallel artifact (options.parallel)."""
        from farm.node.loader import load_artifact

        artifact = resolved.get("artifact", resolved)
        path, verified = self.fetch_verified(resolved)
        fn = load_artifact(path, artifact["format"], module=module, attestation=verified,
                           trust_unverified=verified is None,
                           disable_guard_check=bool(
                               (artifact.get("options") or {}).get("disable_guard_check")),
                           external_data=external_data,
                           # The farm's own weight check (a fake-weight build has
                           # no guards on the weights): farm.node.weight_check.
                           weights_manifest=(artifact.get("meta") or {}).get(
                               "weights_manifest"))
        if mesh is not None:
            from farm.core.parallel import bind_mesh

            # An Inductor TP artifact reloads without its mesh (bind_mesh says why).
            bind_mesh(mesh)
        return fn


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return min(5.0, max(0.0, float(r.headers.get("retry-after", default))))
    except ValueError:
        return default


def _backoff(state: tenacity.RetryCallState) -> float:
    """0.2 s, 0.4 s, ...; or the server's Retry-After (at most 5 s) on a 503."""
    default = 0.2 * 2 ** (state.attempt_number - 1)
    outcome = state.outcome
    if outcome is not None and not outcome.failed:
        return _retry_after(outcome.result(), default)
    return default


# --- the fleet node's load path ---------------------------------------------------

# What loading an artifact imports, heaviest first (2 s on a GPU node for
