"""The fleet client: resolve, download, verify and load the farm's artifacts.

One call makes a module run on the farm's artifact for its inputs::

    import farm.node.client

    fn = farm.node.client.compiled(model, model="llama-1b", ref="prod",
                              example_inputs=["bfloat16[8,512]"])
    out = fn(x)          # the artifact, or JIT torch.compile if the farm had none

A node that loads weights anyway can start the farm's part first and let the
two overlap (the load path, see ``prefetch_compiled``)::

    handle = farm.node.client.prefetch_compiled(model="llama-1b", ref="prod",
                                           example_inputs=["bfloat16[8,512]"],
                                           device="cuda", grad_mode="inference")
    model = build_model().cuda(); model.load_state_dict(torch.load(...))
    fn = handle.bind(model)

Trust. Loading an artifact unpickles it, which runs code. Before anything is
unpickled the client checks (1) that the bytes hash to the digest the farm
named, and (2) the farm's Ed25519 signature over that digest and the
artifact's metadata (format, target, inputs, grad mode, ...). The public key
comes from, in order: the ``public_key`` argument, ``FARM_PUBLIC_KEY`` (PEM text
or a path), or a key pinned on disk the first time this node asked the farm
for it (``GET /v1/public-key``, trust on first use, kept per farm URL under
the cache directory). Configuring the key is the strong choice: a pinned key
trusts whoever answered the first time, and a key fetched over the same
connection as the artifacts only protects against a tampered blob store (S3),
not against a compromised API. Pinning at least means a later compromise of
the API or of the network cannot swap the key; rotate by deleting the pin.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urljoin, urlsplit

import httpx

from farm.core.specs import GradMode, JobSpec, SpecError, TensorSpec, parse_inputs
from farm.core.target import Target, TargetError, detect_local_target
from farm.node.cache import ArtifactCache, CacheCorrupt, CacheError, validate_digest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "partial"})
# The metadata a signature must cover at least; the server says which fields
# it signed ("signed_fields") and the client insists on these among them.
REQUIRED_SIGNED_FIELDS = frozenset({"format", "target", "inputs", "grad_mode", "size"})
_CHUNK = 1 << 20
_MAX_REDIRECTS = 5
_RETRY_STATUSES = frozenset({502, 503, 504})
_GUARD_FAILURE = "GuardManager check failed"


# --- errors ------------------------------------------------------------------


class FarmError(Exception):
    """Anything the farm or the path to it refused; ``str()`` is one clear line."""

    def __init__(self, message: str, *, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class FarmUnavailable(FarmError):
    """The farm could not be reached, or answered 5xx."""


class AuthenticationError(FarmError):
    """401 or 403: no token, a wrong one, or one without the role needed."""


class NotFoundError(FarmError):
    """404. For a resolve, ``rejections`` lists each candidate and why it was refused."""

    def __init__(self, message: str, *, status: int | None = 404, detail: Any = None,
                 rejections: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(message, status=status, detail=detail)
        self.rejections = [dict(r) for r in rejections]


class IntegrityError(FarmError):
    """Downloaded bytes or their signature do not verify: never loaded."""


class JobTimeout(FarmError):
    """``wait`` gave up before the job finished."""


# --- small helpers -------------------------------------------------------------


def _detail_text(detail: Any) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        # FastAPI's validation errors.
        parts = []
        for e in detail:
            if isinstance(e, Mapping):
                loc = ".".join(str(p) for p in e.get("loc", ()))
                parts.append(f"{loc}: {e.get('msg', e)}" if loc else str(e.get("msg", e)))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


def format_rejections(rejections: Sequence[Mapping[str, Any]], *, limit: int = 10) -> str:
    """One line per rejected candidate, for logs and the CLI."""
    lines = []
    for r in rejections[:limit]:
        digest = str(r.get("digest") or "")[:12]
        where = f" [{r['target']}]" if r.get("target") else ""
        lines.append(f"  {digest or '?'} {r.get('format', '')}{where}: "
                     f"{r.get('reason') or r.get('code') or r}")
    if len(rejections) > limit:
        lines.append(f"  ... and {len(rejections) - limit} more")
    return "\n".join(lines)


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


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
    """Input specs from spec strings, ``TensorSpec``s or example tensors (static shapes)."""
    if inputs is None:
        raise SpecError("input specs are needed to resolve an artifact")
    if isinstance(inputs, str):
        return parse_inputs(p for p in inputs.split(";") if p)
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
    return tuple(out)


def as_target(target: Target | str | None, device: str | None = None) -> Target:
    if isinstance(target, Target):
        return target
    if target is None or target == "auto":
        # A node: what it can run depends on its CPU, not on a compiler.
        return detect_local_target(device, check_compiler=False)
    return Target.parse(target)


# --- the client ----------------------------------------------------------------


class FarmClient:
    """The farm's HTTP API, a verified download path and a local cache.

    ``url`` and ``token`` default to ``FARM_URL`` and ``FARM_TOKEN``; ``cache``
    to an ``ArtifactCache`` at ``CLIENT_CACHE_DIR`` bounded by
    ``CLIENT_CACHE_MAX_BYTES``. Safe to share between threads.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        public_key: Any = None,
        cache: ArtifactCache | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        require_signature: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        from farm.core.settings import get_settings

        settings = get_settings()
        self.url = (url or settings.farm_url).rstrip("/")
        self.token = settings.farm_token if token is None else token
        self._public_key_source = public_key if public_key is not None else (
            settings.farm_public_key or None)
        self._public_key: Ed25519PublicKey | None = None
        self._key_lock = threading.Lock()
        self._cache = cache
        self._cache_lock = threading.Lock()
        self.retries = retries
        self.require_signature = require_signature
        t = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        headers = {"User-Agent": "torch-farm-client"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=t,
                                  follow_redirects=False, transport=transport)
        # For presigned URLs on another origin: never carries the farm token.
        self._bare = httpx.Client(timeout=t, follow_redirects=False, transport=transport,
                                  headers={"User-Agent": "torch-farm-client"})

    def close(self) -> None:
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
        GETs are retried on connection errors and 502/503/504."""
        attempts = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                if last:
                    raise FarmUnavailable(
                        f"cannot reach the farm at {self.url}: {exc or type(exc).__name__}"
                    ) from None
                time.sleep(0.2 * 2**attempt)
                continue
            if r.status_code in _RETRY_STATUSES and not last:
                time.sleep(_retry_after(r, 0.2 * 2**attempt))
                continue
            self._raise_for(r, f"{method} {path}")
            if r.status_code == 204 or not r.content:
                return None
            try:
                return r.json()
            except ValueError:
                raise FarmError(f"{method} {path}: the farm answered {r.status_code} with "
                                "something that is not JSON", status=r.status_code) from None
        raise AssertionError("unreachable")  # pragma: no cover

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

    def submit(self, spec: JobSpec | Mapping[str, Any]) -> dict[str, Any]:
        body = spec.to_json() if isinstance(spec, JobSpec) else dict(spec)
        return dict(self._request("POST", "/v1/jobs", json=body))

    def job(self, job_id: str) -> dict[str, Any]:
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
                raise JobTimeout(f"job {job_id} still {view.get('state')} after {timeout:g} s",
                                 detail=view)
            pause = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)
            delay = min(poll_s, delay * 2)

    def models(self) -> list[dict[str, Any]]:
        body = self._request("GET", "/v1/models")
        return list(body.get("models", []) if isinstance(body, dict) else body)

    def set_alias(self, model: str, alias: str, version: str) -> dict[str, Any]:
        return dict(self._request(
            "PUT", f"/v1/models/{quote(model, safe='')}/aliases/{quote(alias, safe='')}",
            json={"version": version}))

    def create_token(self, name: str, role: str) -> dict[str, Any]:
        """A new API token (admin only); the answer holds the plaintext, shown once."""
        return dict(self._request("POST", "/v1/tokens", json={"name": name, "role": role}))

    def targets(self) -> Any:
        return self._request("GET", "/v1/targets")

    def resolve(
        self,
        model: str,
        ref: str | None = None,
        inputs: Any = None,
        grad_mode: GradMode | str | bool | None = GradMode.INFERENCE,
        target: Target | str | None = "auto",
        *,
        formats: Sequence[str] | None = None,
        options: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The farm's best artifact for this node; ``NotFoundError`` (with the
        rejection reasons) when none fits."""
        import json

        specs = as_input_specs(inputs)
        params: list[tuple[str, str]] = [("model", model),
                                         ("target", str(as_target(target))),
                                         ("grad_mode", as_grad_mode(grad_mode).value)]
        params += [("input", str(s)) for s in specs]
        if ref:
            params.append(("ref", ref))
        for f in formats or ():
            params.append(("format", f))
        if options:
            params.append(("options", json.dumps(dict(options), sort_keys=True)))
        return dict(self._request("GET", "/v1/resolve", params=params))

    def report_miss(
        self,
        model: str,
        ref: str | None,
        inputs: Any,
        grad_mode: GradMode | str | bool | None,
        target: Target | str,
        reasons: Sequence[Any],
    ) -> None:
        """Tell the farm this node did not use its artifact (best effort: never raises)."""
        try:
            self._request("POST", "/v1/misses", json={
                "model": model, "ref": ref,
                "inputs": [str(s) for s in as_input_specs(inputs)],
                "grad_mode": as_grad_mode(grad_mode).value,
                "target": str(as_target(target)),
                "reasons": [r if isinstance(r, Mapping) else {"reason": str(r)}
                            for r in reasons][:256],
            })
        except (FarmError, SpecError, TargetError) as exc:
            log.debug("could not report the miss to the farm: %s", exc)

    # --- trust -------------------------------------------------------------------

    def public_key(self) -> Ed25519PublicKey:
        """The key artifacts must be signed with (see the module docstring)."""
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
                raise IntegrityError(f"farm public key: {exc}") from None
            self._public_key = key
            return key

    def _pin_path(self) -> Path:
        name = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return self.cache.root / "trusted-keys" / f"{name}.pem"

    def _pinned_key(self) -> Ed25519PublicKey:
        from farm.core.signing import key_id, load_public_key, public_key_pem

        pin = self._pin_path()
        if pin.exists():
            return load_public_key(pin)
        try:
            r = self._http.get("/v1/public-key")
        except httpx.TransportError as exc:
            raise FarmUnavailable(f"cannot reach the farm at {self.url} for its public key: "
                                  f"{exc or type(exc).__name__}") from None
        self._raise_for(r, "GET /v1/public-key")
        text = r.text
        with contextlib.suppress(ValueError):
            body = r.json()
            if isinstance(body, dict):
                text = str(body.get("public_key") or body.get("pem") or body.get("key") or "")
        key = load_public_key(text)
        pin.parent.mkdir(parents=True, exist_ok=True)
        tmp = pin.with_name(f".{pin.name}.{os.getpid()}.tmp")
        tmp.write_text(public_key_pem(key))
        with contextlib.suppress(FileExistsError):
            # First writer wins; everyone then trusts what is on disk.
            os.link(tmp, pin)
        tmp.unlink()
        log.warning("trusting farm key %s from %s on first use (pinned in %s); set "
                    "FARM_PUBLIC_KEY to configure it instead", key_id(key), self.url, pin)
        return load_public_key(pin)

    def verify_signature(self, artifact: Mapping[str, Any]) -> None:
        """Raise ``IntegrityError`` unless the farm's key signed this artifact's
        digest and metadata. Needs no bytes: call it before downloading."""
        from farm.core.signing import SignatureInvalid, verify_artifact_signature

        try:
            digest = validate_digest(artifact.get("digest"))
        except CacheError as exc:
            raise IntegrityError(f"the farm named an artifact by a bad digest: {exc}") from None
        signature = artifact.get("signature")
        if not signature:
            if self.require_signature:
                raise IntegrityError(f"artifact {digest[:12]} is not signed; refusing it")
            log.warning("artifact %s is not signed (require_signature=False)", digest[:12])
            return
        fields = artifact.get("signed_fields")
        if not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields):
            raise IntegrityError(f"artifact {digest[:12]}: the farm did not say which fields "
                                 "it signed (signed_fields)")
        missing = REQUIRED_SIGNED_FIELDS - set(fields)
        if missing:
            raise IntegrityError(f"artifact {digest[:12]}: signature does not cover "
                                 f"{', '.join(sorted(missing))}; refusing it")
        try:
            metadata = {f: artifact[f] for f in fields}
        except KeyError as exc:
            raise IntegrityError(f"artifact {digest[:12]}: signed field {exc.args[0]!r} "
                                 "is missing from the farm's answer") from None
        try:
            verify_artifact_signature(self.public_key(), digest, metadata, str(signature))
        except SignatureInvalid as exc:
            raise IntegrityError(str(exc)) from None

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

    def fetch(self, resolved: Mapping[str, Any]) -> Path:
        """Verify the signature, then download into the cache (or find it there),
        checking the sha256. Returns the cached path; nothing is unpickled."""
        artifact = resolved.get("artifact", resolved)
        if not isinstance(artifact, Mapping):
            raise FarmError("fetch needs a resolve answer or its 'artifact'")
        self.verify_signature(artifact)
        digest = str(artifact["digest"])  # validated by verify_signature
        size = artifact.get("size")
        size = int(size) if isinstance(size, int) else None
        path = self.cache.get(digest, size=size)
        if path is not None:
            return path
        try:
            return self.cache.put_stream(digest, self._blob_chunks(digest), size=size)
        except CacheCorrupt as exc:
            raise IntegrityError(str(exc)) from None
        except CacheError as exc:
            raise FarmError(f"cache: {exc}") from None

    def load(self, resolved: Mapping[str, Any], *, module: Any = None) -> Callable[..., Any]:
        """Fetch and verify (see ``fetch``), then load the artifact."""
        from farm.node.loader import load_artifact

        artifact = resolved.get("artifact", resolved)
        path = self.fetch(resolved)
        return load_artifact(path, artifact["format"], module=module)


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return min(5.0, max(0.0, float(r.headers.get("retry-after", default))))
    except ValueError:
        return default


# --- the fleet node's load path ---------------------------------------------------

# What loading an artifact imports, heaviest first (2 s on a GPU node for
# torch._inductor alone). Names that a torch version lacks are skipped.
_WARM_MODULES = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._functorch.aot_autograd",
    "torch._dynamo.aot_compile",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.hooks",
    "torch.utils.cpp_extension",
)


# Formats whose loading imports _WARM_MODULES. An AOTI package needs none of
# them (its kernels are in a shared library); importing them anyway would take
# the GIL from the node's own start for seconds (measured on the H200: the
# model build beside them went from 2.0 to 3.4 s).
_FORMATS_NEEDING_WARM_IMPORTS = frozenset({"aot_compile"})


def warm_imports() -> float:
    """Import what loading an artifact needs; returns the seconds it took."""
    import importlib

    t0 = time.perf_counter()
    for name in _WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module this torch does not have
            log.debug("warm import of %s skipped: %s", name, exc)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Prefetched:
    """A verified artifact in the local cache, ready to load."""

    model: str
    ref: str | None
    version: str | None
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode
    target: Target
    artifact: dict[str, Any]
    path: Path
    timings: dict[str, float]

    @property
    def format(self) -> str:
        return str(self.artifact["format"])

    @property
    def digest(self) -> str:
        return str(self.artifact["digest"])


class CompiledHandle:
    """The farm's side of loading a model, running in the background.

    ``result()`` waits for the resolve, download and verification and returns
    a ``Prefetched`` (or raises the ``FarmError`` that stopped it);
    ``bind(module)`` loads the artifact for ``module`` and returns the callable,
    falling back to JIT ``torch.compile`` if anything failed.
    """

    def __init__(self, *, model: str, ref: str | None, inputs: tuple[TensorSpec, ...],
                 grad_mode: GradMode, target: Target | str | None, device: str | None,
                 client: FarmClient | None, overlap: bool, warm: bool,
                 formats: Sequence[str] | None = None) -> None:
        self.model = model
        self.ref = ref
        self.inputs = inputs
        self.grad_mode = grad_mode
        self._target_arg = target
        self._device = device
        self._client = client
        self._formats = tuple(formats) if formats is not None else None
        self._warm_wanted = warm and overlap
        self._future: concurrent.futures.Future[Prefetched] = concurrent.futures.Future()
        self._import_thread: threading.Thread | None = None
        self.timings: dict[str, float] = {}
        self.target: Target | None = None
        if overlap:
            threading.Thread(target=self._run, name="farm-prefetch", daemon=True).start()
        else:
            self._run()

    @property
    def client(self) -> FarmClient:
        if self._client is None:
            self._client = default_client()
        return self._client

    def _warm(self) -> None:
        self.timings["warm_imports_s"] = warm_imports()

    def _run(self) -> None:
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            self._future.set_result(self._prefetch())
        except BaseException as exc:
            self._future.set_exception(exc)

    def _prefetch(self) -> Prefetched:
        t0 = time.perf_counter()
        try:
            target = as_target(self._target_arg, self._device)
        except TargetError as exc:
            raise FarmError(f"cannot describe this node as a target: {exc}") from None
        self.target = target
        t1 = time.perf_counter()
        resolved = self.client.resolve(self.model, self.ref, self.inputs, self.grad_mode, target,
                                       formats=self._formats)
        t2 = time.perf_counter()
        fmt = resolved["artifact"].get("format")
        if self._warm_wanted and fmt in _FORMATS_NEEDING_WARM_IMPORTS:
            # Beside the download and verification, which wait on the network
            # and hashlib (both release the GIL).
            self._import_thread = threading.Thread(target=self._warm, name="farm-warm-imports",
                                                   daemon=True)
            self._import_thread.start()
        path = self.client.fetch(resolved)
        t3 = time.perf_counter()
        self.timings.update(target_s=t1 - t0, resolve_s=t2 - t1, fetch_verify_s=t3 - t2)
        return Prefetched(model=self.model, ref=self.ref, version=resolved.get("version"),
                          inputs=self.inputs, grad_mode=self.grad_mode, target=target,
                          artifact=dict(resolved["artifact"]), path=path, timings=self.timings)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Prefetched:
        return self._future.result(timeout)

    def bind(self, module_or_fn: Any, *, fallback: bool = True,
             timeout: float | None = None) -> Callable[..., Any]:
        """The callable that runs ``module_or_fn`` on the farm's artifact.

        With ``fallback`` (the default) any failure (no artifact, a download,
        signature or load error) logs why and returns JIT
        ``torch.compile(module_or_fn, fullgraph=True)`` instead; without it,
        the error is raised.
        """
        try:
            pre = self.result(timeout)
        except Exception as exc:
            # Any failure of the farm's side (a miss, the network, a bad
            # answer, a full disk) is a reason to run JIT, never to crash.
            if not fallback:
                raise
            self._explain(exc)
            return FarmCompiled(None, module_or_fn, prefetched=None, reason=_one_line(exc))
        if self._import_thread is not None:
            # Loading would import the same modules: wait for ours rather
            # than contend with it on import locks.
            self._import_thread.join()
        t0 = time.perf_counter()
        try:
            from farm.node.loader import load_artifact

            fn = load_artifact(pre.path, pre.format, module=module_or_fn)
        except Exception as exc:
            if not fallback:
                raise
            reason = f"loading artifact {pre.digest[:12]} ({pre.format}) failed: {_one_line(exc)}"
            log.warning("torch-farm: %s; using JIT torch.compile instead", reason)
            self.client.report_miss(self.model, pre.version or self.ref, self.inputs,
                                    self.grad_mode, pre.target,
                                    [{"code": "load_failed", "digest": pre.digest,
                                      "reason": reason}])
            return FarmCompiled(None, module_or_fn, prefetched=pre, reason=reason)
        self.timings["load_s"] = time.perf_counter() - t0
        log.info("torch-farm: %s@%s runs artifact %s (%s) for %s", self.model,
                 pre.version, pre.digest[:12], pre.format, pre.target)
        return FarmCompiled(fn, module_or_fn, prefetched=pre, reason=None)

    def _explain(self, exc: BaseException) -> None:
        what = f"{self.model}@{self.ref or 'latest'} for {', '.join(map(str, self.inputs))} " \
               f"({self.grad_mode.value})"
        if isinstance(exc, NotFoundError):
            # The farm records resolve misses itself; only say why here.
            reasons = format_rejections(exc.rejections)
            log.warning("torch-farm: no artifact for %s: %s; using JIT torch.compile%s",
                        what, exc, f"\n{reasons}" if reasons else "")
            return
        log.warning("torch-farm: not using the farm for %s: %s; using JIT torch.compile",
                    what, _one_line(exc))
        if (isinstance(exc, FarmError) and not isinstance(exc, FarmUnavailable)
                and self.target is not None):
            code = "integrity" if isinstance(exc, IntegrityError) else "fetch_failed"
            self.client.report_miss(self.model, self.ref, self.inputs, self.grad_mode, self.target,
                                    [{"code": code, "reason": _one_line(exc)}])


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class FarmCompiled:
    """What ``compiled`` returns: calls the artifact, or JIT when there is none.

    ``source`` is ``"farm"`` or ``"jit"``; ``reason`` says why JIT was used.
    A call the artifact's guards reject (another grad mode, shape or dtype
    than it was built for) runs on JIT as well, rather than failing: guards
    are checked before any kernel runs, so nothing ran twice.
    """

    def __init__(self, fn: Callable[..., Any] | None, original: Any, *,
                 prefetched: Prefetched | None, reason: str | None) -> None:
        self._fn = fn
        self._original = original
        self._jit: Callable[..., Any] | None = None
        self._jit_lock = threading.Lock()
        self.prefetched = prefetched
        self.reason = reason
        self._warned_guard = False
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())

    @property
    def source(self) -> str:
        return "farm" if self._fn is not None else "jit"

    @property
    def artifact(self) -> dict[str, Any] | None:
        return self.prefetched.artifact if self.prefetched else None

    def jit(self) -> Callable[..., Any]:
        with self._jit_lock:
            if self._jit is None:
                import torch

                self._jit = torch.compile(self._original, fullgraph=True)
            return self._jit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            return self.jit()(*args, **kwargs)
        try:
            return self._fn(*args, **kwargs)
        except RuntimeError as exc:
            if not str(exc).startswith(_GUARD_FAILURE):
                raise
            if not self._warned_guard:
                self._warned_guard = True
                log.warning("torch-farm: this call does not fit the artifact's guards (%s); "
                            "such calls run on JIT torch.compile", _guard_reason(exc))
            return self.jit()(*args, **kwargs)

    def __repr__(self) -> str:
        if self.prefetched is not None and self._fn is not None:
            return f"<FarmCompiled farm artifact {self.prefetched.digest[:12]}>"
        return f"<FarmCompiled jit ({self.reason})>"


def _guard_reason(exc: BaseException) -> str:
    text = str(exc)
    start = text.find("verbose_code_parts=")
    if start >= 0:
        end = text.find("]", start)
        return text[start + len("verbose_code_parts="):end + 1]
    return _one_line(exc)


_default_client: FarmClient | None = None
_default_lock = threading.Lock()


def default_client() -> FarmClient:
    """One client per process, configured from the environment."""
    global _default_client
    with _default_lock:
        if _default_client is None:
            _default_client = FarmClient()
        return _default_client


def _module_device(module_or_fn: Any, example_inputs: Any) -> str | None:
    for get in ("parameters", "buffers"):
        it = getattr(module_or_fn, get, None)
        if callable(it):
            for p in it():
                return str(p.device.type)
    for x in example_inputs or ():
        if hasattr(x, "device") and hasattr(x, "shape"):
            return str(x.device.type)
    return None


def prefetch_compiled(
    *,
    model: str,
    ref: str | None = None,
    example_inputs: Any,
    grad_mode: GradMode | str | bool | None = None,
    target: Target | str | None = "auto",
    device: str | None = None,
    client: FarmClient | None = None,
    overlap: bool = True,
    warm_imports: bool = True,
    formats: Sequence[str] | None = None,
) -> CompiledHandle:
    """Start resolving, downloading and verifying the artifact (and importing
    what loading it needs) in the background; ``.bind(module)`` later.

    ``device`` (``"cpu"``, ``"cuda"``) picks the target with ``target="auto"``;
    None means CUDA when present. ``grad_mode`` None means the grad mode in
    force now: pass it explicitly when the model will be called under
    ``torch.no_grad()`` but this call is not. ``formats`` limits the artifact
    formats this node takes (default: any, the resolver's preference).
    """
    specs = as_input_specs(example_inputs)
    mode = as_grad_mode(grad_mode)
    if device is not None and ":" in device:
        device = device.split(":", 1)[0]
    return CompiledHandle(model=model, ref=ref, inputs=specs, grad_mode=mode, target=target,
                          device=device, client=client, overlap=overlap, warm=warm_imports,
                          formats=formats)


def compiled(
    module_or_fn: Any,
    *,
    model: str,
    ref: str | None = None,
    example_inputs: Any = None,
    grad_mode: GradMode | str | bool | None = None,
    target: Target | str | None = "auto",
    client: FarmClient | None = None,
    fallback: bool = True,
    overlap: bool = True,
    formats: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Run ``module_or_fn`` on the farm's artifact for its inputs.

    Detects this node's target (of the module's device), resolves
    (``model``, ``ref``, inputs, grad mode, target), downloads into the local
    cache, verifies digest and signature, loads, and returns the callable.
    With ``fallback`` any failure logs why (the resolver's rejection reasons
    on a miss) and returns JIT ``torch.compile(module_or_fn, fullgraph=True)``.

    ``example_inputs``: spec strings, ``TensorSpec``s or example tensors; if
    None, the first call's positional arguments are used (and the farm is
    asked then). With ``overlap`` the imports that loading needs run beside
    the resolve and download.
    """
    device = _module_device(module_or_fn, example_inputs)
    if example_inputs is None:
        return _OnFirstCall(module_or_fn, model=model, ref=ref, grad_mode=grad_mode,
                            target=target, client=client, fallback=fallback, formats=formats)
    try:
        handle = prefetch_compiled(model=model, ref=ref, example_inputs=example_inputs,
                                   grad_mode=grad_mode, target=target, device=device,
                                   client=client, overlap=overlap, formats=formats)
    except (SpecError, TargetError) as exc:
        if not fallback:
            raise
        log.warning("torch-farm: cannot ask the farm (%s); using JIT torch.compile", exc)
        return FarmCompiled(None, module_or_fn, prefetched=None, reason=str(exc))
    return handle.bind(module_or_fn, fallback=fallback)


class _OnFirstCall:
    """``compiled`` without example inputs: ask the farm at the first call."""

    def __init__(self, module_or_fn: Any, **kw: Any) -> None:
        self._original = module_or_fn
        self._kw = kw
        self._impl: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._impl is None:
            with self._lock:
                if self._impl is None:
                    kw = dict(self._kw)
                    if kw["grad_mode"] is None:
                        kw["grad_mode"] = as_grad_mode(None)  # the mode of this call
                    self._impl = compiled(self._original, example_inputs=list(args),
                                          overlap=False, **kw)
        return self._impl(*args, **kwargs)
