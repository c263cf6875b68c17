"""The farm's HTTP API as a Python object: submit and watch jobs, resolve,
download (attestations and digest checked) and load artifacts.

Trust (what is checked before anything is loaded): ``farm.node.trust``'s
``FarmTrust``, which this client extends.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import httpx

from farm.core.specs import CompileOptions, GradMode, JobSpec
from farm.core.target import Target
from farm.node.arguments import as_grad_mode, as_input_specs, as_target
from farm.node.cache import CacheCorrupt, CacheError
from farm.node.errors import FarmError, FarmUnavailable, IntegrityError, JobTimeout, NotFoundError
from farm.node.http import origin
from farm.node.reports import Report, Reporter
from farm.node.trust import NODE_REQUEST, FarmTrust

if TYPE_CHECKING:

    from farm.node.verify import NodeRequest, Verified

log = logging.getLogger(__name__)

TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "partial"})
_CHUNK = 1 << 20
_MAX_REDIRECTS = 5


class FarmClient(FarmTrust):
    """The farm's HTTP API (``FarmAdmin``'s calls, ``FarmTrust``'s keys), submission with code, and
    a fleet node's path: resolve, verify, fetch into a local cache, load.

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
        reports: bool | None = None,
        **session: Any,
    ) -> None:
        """``session``: ``FarmTrust``'s keywords (root_key, public_key, cache,
        timeout, retries, allow_http, transport)."""
        from farm.core.settings import get_settings

        super().__init__(url, token, **session)
        settings = get_settings()
        self._reporter: Reporter | None = None
        self._reports_on = settings.farm_reports if reports is None else reports
        self._report_interval_s = settings.farm_report_interval_s

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()
        super().close()

    def submit(self, spec: JobSpec | Mapping[str, Any], *,
               source: str | os.PathLike[str] | bool | None = None,
               wheels: Sequence[str | os.PathLike[str]] = (),
               requirements: str | os.PathLike[str] | None = None,
               rebuild: bool = False) -> dict[str, Any]:
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
        nothing did). ``rebuild``: compile even where the farm has this
        program's artifacts, and replace them.
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
        body = {**spec.to_json(), **({"rebuild": True} if rebuild else {})}
        out = dict(self._request("POST", "/v1/jobs", json=body))
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
                "source_bytes": _file_bytes(p.data),
                "source": ", ".join(shipped), "uploaded": uploaded}

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
        artifact = answer.get("artifact")
        if isinstance(artifact, Mapping):
            # Fetched (or found kept) by digest now, so an answer kept for
            # offline use is whole; fetch() verifies it before any byte loads.
            try:
                answer["artifact"] = {**artifact, "attestation": self.complete_attestation(
                    artifact.get("attestation"))}
            except FarmError as exc:
                log.debug("build statement not fetched with the answer: %s", exc)
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

    def _blob_chunks(self, digest: str) -> Iterator[bytes]:
        """The blob's bytes from the API, following a redirect to presigned
        storage without the farm token (a generator: nothing is requested
        until it is iterated)."""
        url = f"{self.url}/v1/artifacts/{digest}/blob"
        api = origin(self.url)
        for _ in range(_MAX_REDIRECTS + 1):
            client = self._http if origin(url) == api else self._bare
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
                       request: NodeRequest | None = None) -> tuple[Path, Verified]:
        """Verify the attestations, then download into the cache (or find it
        there) checking the attested sha256 and size. Nothing is unpickled,
        and nothing unattested is fetched."""
        artifact = resolved.get("artifact", resolved)
        if not isinstance(artifact, Mapping):
            raise FarmError("fetch needs a resolve answer or its 'artifact'")
        verified = self.verify_signature(resolved, request=request)
        digest, size = verified.digest, verified.size
        path = self.cache.get(digest, size=size)
        if path is None:
            try:
                path = self.cache.put_stream(digest, self._blob_chunks(digest), size=size)
            except CacheCorrupt as exc:
                raise IntegrityError(str(exc)) from None
            except CacheError as exc:
                raise FarmError(f"cache: {exc}") from None
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
        return make_bundle(attestation=self.complete_attestation(artifact["attestation"]),
                           trust_list=self.trust_list(),
                           request=verified.request, farm_url=self.url)

    def load(self, resolved: Mapping[str, Any], *, module: Any = None,
             external_data: Mapping[str, Any] | None = None,
             mesh: Any = None, class_of: Any = None) -> Callable[..., Any]:
        """Fetch and verify (see ``fetch_verified``), then load the artifact.
        ``external_data``: this node's objects for a function artifact that
        captures them, by the names its job declared. ``mesh``: this rank's
        DeviceMesh, for a tensor-parallel artifact (options.parallel).
        ``class_of``: the object the artifact must have been built from; its
        class is checked against the signed statement's ``model_class``
        (ValueError when it differs), before anything is unpickled."""
        from farm.node.compiled import class_mismatch
        from farm.node.loader import load_artifact

        artifact = resolved.get("artifact", resolved)
        path, verified = self.fetch_verified(resolved)
        if class_of is not None:
            why = class_mismatch(dict(artifact), class_of,
                                 signed=verified.build if verified is not None else None)
            if why is not None:
                raise ValueError(why)
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


def _file_bytes(tar: bytes) -> int:
    """The bytes of the files in a code pack (a tar's headers and padding
    make even a one-line file a 10 KB pack)."""
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return sum(m.size for m in t.getmembers() if m.isfile())
