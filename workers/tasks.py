"""Celery tasks: thin. They move ids between the queue, the sandbox that runs
model code, the blob store and ``registry.service``.

Retry policy: only infrastructure errors (database or blob store unreachable)
are retried, with backoff and a bound; a model that fails to trace or compile
is a failed build with its traceback, never a retry.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Task
from celery.exceptions import Retry
from sqlalchemy.exc import OperationalError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from farm.build import zygote
from farm.build.child_output import ChildOutputError, TakenArtifact, take_artifacts, worker_dir
from farm.build.codeenv import NO_DEPS_HINT, CodeUnavailable, code_dir, code_root, env_dir, env_root
from farm.build.compile_cache import CacheSession, open_store, scoped_namespace
from farm.build.isolation import Isolation, SandboxUnavailable
from farm.build.sandbox import SandboxResult, build_isolation, run_isolated
from farm.build.steps import TRACE_STEP, compile_env
from farm.build.toolchain import current_compiler
from farm.core.specs import JobSpec
from farm.core.target import Target
from farm.core.text import readable_tensors
from registry import service
from registry.db import DatabaseUnavailable
from registry.service.cache import cache_salt
from workers import context
from workers.app import app
from workers.build_timings import BuildTimings
from workers.routing import COMPILE_TASK, TRACE_TASK
from workers.timing import FINISH_WAIT_S, DeadlineExceeded, deadline

log = logging.getLogger(__name__)

# Errors of the farm's own infrastructure, worth retrying.
RETRYABLE: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    OperationalError,
    ConnectionError,
    TimeoutError,
    DeadlineExceeded,  # a code download or an upload past its limit (workers.timing)
)
try:  # botocore is only there with the S3 store
    from botocore.exceptions import BotoCoreError, ClientError

    RETRYABLE = (*RETRYABLE, BotoCoreError, ClientError)
except ImportError:  # pragma: no cover
    pass


class FarmTask(Task):
    acks_late = True
    reject_on_worker_lost = True
    max_retries = 8
    retry_backoff = True
    retry_backoff_max = 120
    retry_jitter = True
    autoretry_for = RETRYABLE


AOTI_OFF = ("AOTI packages are off on this farm (FARM_AOTI=0): nodes get the aot_compile "
            "artifact")


def _sandbox_error(res: SandboxResult) -> tuple[str, str]:
    """A one-paragraph error and the full log for a failed child."""
    if res.timed_out:
        head = f"timed out after {res.wall_s:.0f} s"
    elif res.oom:
        head = res.describe()  # the peak, what took the memory, the setting that raises it
    elif res.signal:
        # Where: its announced native phase and last Python frame.
        where = res.crash_site()
        head = f"crashed with signal {res.signal}" + (f" {where}" if where else "")
    else:
        head = (
            f"{res.error_type}: {res.error}"
            if res.error_type
            else f"exited with code {res.exit_code}"
        )
    parts = [head]
    if res.limits:
        parts.append(f"limits: {res.limits}")
    if res.traceback:
        parts.append(res.traceback)
    if res.stderr_tail:
        parts.append("--- stderr (tail) ---\n" + res.stderr_tail)
    # The error a user reads names each fake tensor by dtype and shape; the
    # log keeps torch's message as it was.
    return readable_tensors(head), "\n".join(parts)


def _code_paths(spec: JobSpec) -> list[str]:
    """The job's code pack, unpacked read-only once per digest on this
    worker: what goes first on the build child's path (none for code that is
    installed here, e.g. farm.zoo). Raises ``CodeUnavailable``."""
    if spec.code_digest is None:
        return []
    from registry.blobstore import BlobNotFound

    s = context.settings()
    store = context.blob_store()
    try:
        where = code_dir(spec.code_digest, fetch=store.get_to_file,
                         root=code_root(s.farm_home), max_bytes=s.code_pack_max_bytes)
    except BlobNotFound:
        raise CodeUnavailable(
            f"code pack {spec.code_digest[:12]} is not in the farm's blob store: upload it "
            "(PUT /v1/code/<digest>, which farm submit and FarmClient.submit do) and submit "
            "again") from None
    # Its wheels and pins, installed here (the sandbox has no network), after
    # the pack on the child's path and before the worker's own packages.
    env = env_dir(spec.code_digest, where, root=env_root(s.farm_home),
                  find_links=s.farm_pip_find_links, index_url=s.farm_pip_index_url)
    return [str(where)] if env is None else [str(where), str(env)]


def _with_hint(head: str, res: SandboxResult, paths: list[str]) -> str:
    """A failed import of a job whose pack has wheels or pins says that their
    dependencies were not installed (the commonest cause)."""
    kind = (res.error_type or "").rsplit(".", 1)[-1]
    # The entrypoint's own import is a ModelImportError that quotes the cause.
    missing = kind in ("ModuleNotFoundError", "ImportError") or (
        kind == "ModelImportError" and "No module named" in (res.error or ""))
    if len(paths) > 1 and missing:
        return f"{head} ({NO_DEPS_HINT})"
    return head


def enqueue_trace(job_id: str) -> None:
    trace_task.apply_async((job_id,))


def enqueue_compile(dispatch: service.CompileDispatch) -> None:
    compile_task.apply_async((dispatch.build_key, dispatch.target), queue=dispatch.queue)


@app.task(name=TRACE_TASK, base=FarmTask, bind=True)
def trace_task(self: Task, job_id: str) -> None:
    db = context.database()
    s = context.settings()
    spec = service.start_trace(db, job_id, worker_id=context.worker_id())
    if spec is None:
        log.info("job %s is past tracing; nothing to do", job_id)
        return
    try:
        with deadline(s.farm_code_fetch_timeout_s, "fetching the job's code"):
            paths = _code_paths(spec)
        isolation = build_isolation(what=f"trace of job {job_id}")
    except (CodeUnavailable, SandboxUnavailable) as exc:
        log.warning("job %s cannot be traced: %s", job_id, exc)
        service.fail_job(db, job_id, error=str(exc))
        return
    res = run_isolated(
        TRACE_STEP,
        {"spec": spec.to_json()},
        timeout_s=s.trace_timeout_s,
        memory_mb=s.build_memory_mb,
        import_paths=paths,
        isolation=isolation,
    )
    if not res.ok:
        head, full = _sandbox_error(res)
        head = _with_hint(head, res, paths)
        log.warning("job %s failed to trace: %s", job_id, head)
        service.fail_job(db, job_id, error=head, log_text=full)
        return
    assert res.value is not None
    for d in service.record_trace(db, job_id, res.value):
        enqueue_compile(d)
    # Identical jobs waiting behind this one take its trace instead of a
    # process and seconds each (a rollout submits one job hundreds of times).
    shared, dispatch = service.record_trace_for_identical(db, job_id, res.value)
    if shared:
        log.info("trace of job %s shared with %d identical queued jobs", job_id, len(shared))
    for d in dispatch:
        enqueue_compile(d)


@app.task(name=COMPILE_TASK, base=FarmTask, bind=True)
def compile_task(self: Task, build_key: str, target_text: str) -> None:
    db = context.database()
    target = Target.parse(target_text)
    me = context.local_target(target.device)
    if me != target:
        # Routing sent us another target's work (misconfigured queues): give it back.
        from celery.exceptions import Reject

        raise Reject(f"worker target {me} is not {target}", requeue=True)
    decision = service.begin_compile(
        db,
        build_key,
        worker_id=context.worker_id(),
        heartbeat_max_age_s=context.heartbeat_max_age_s(),
    )
    if decision.action == "done":
        return
    if decision.action == "busy":
        # Another live worker owns it (we got a redelivery). Check back later
        # rather than drop the message: if that worker dies, we take over.
        raise self.retry(countdown=15, max_retries=None)
    assert decision.spec is not None and decision.fingerprint is not None
    try:
        _compile_and_store(build_key, target, decision.spec, decision.fingerprint)
    except Retry:
        raise
    except RETRYABLE:
        # The retry may reach another worker: let it take the claim. (If the
        # database is what failed, this fails too, and the claim stays ours:
        # the retry then waits for this worker or for its heartbeat to stop.)
        try:
            service.release_claim(db, build_key, worker_id=context.worker_id())
        except Exception:
            log.warning("could not release the claim on %s", build_key[:12], exc_info=True)
        raise
    except Exception as exc:  # a bug of ours: fail the build, keep the worker serving
        log.exception("compile of %s failed", build_key)
        service.fail_compile(db, build_key, error=f"internal error: {exc!r}")


def _compile_and_store(build_key: str, target: Target, spec: JobSpec, fingerprint: str) -> None:
    from farm.build.compile import ARTIFACT_FILES, aoti_not_applicable, aoti_unavailable_reason

    db = context.database()
    s = context.settings()
    clock = BuildTimings()
    # In this worker's zygote slot (farm.build.zygote): the build's children
    # then fork from a warm, sandboxed interpreter instead of importing torch.
    with tempfile.TemporaryDirectory(prefix="farm-build-", dir=zygote.work_dir()) as tmp:
        try:
            with (deadline(s.farm_code_fetch_timeout_s, "fetching the job's code"),
                  clock.stage("code fetch")):
                paths = _code_paths(spec)
            isolation = build_isolation(writable=(tmp,), what=f"build {build_key[:12]}")
        except (CodeUnavailable, SandboxUnavailable) as exc:
            service.fail_compile(db, build_key, error=str(exc))
            return
        # Once per machine (cached), before the clock: the host's question.
        # On a farm without AOTI, a model that could never have a package
        # still says its own reason (training, another backend): it is the
        # one that holds wherever the model is built.
        no_aoti = (aoti_unavailable_reason(spec, target.device) if s.farm_aoti
                   else aoti_not_applicable(spec) or AOTI_OFF)
        t0 = time.monotonic()
        out_dir = Path(tmp) / "out"
        # Before the sandbox: the child compiles in caches this worker filled
        # from the target's shared store; it never reaches the store itself.
        with clock.stage("cache prefill"):
            cache = _shared_cache(target, Path(tmp), model=spec.name, project=spec.project)
        _stage(db, build_key, "compiling")
        res = run_isolated(
            "farm.build.steps:compile_step",
            # The fingerprint: the child checks it builds the graph the trace saw.
            {"spec": spec.to_json(), "device": target.device, "out_dir": str(out_dir),
             "aoti_unavailable": no_aoti, "fingerprint": fingerprint,
             # The compiler that answer chose: the child adopts it, never probes.
             "cxx": current_compiler()},
            timeout_s=s.build_timeout_s,
            memory_mb=s.build_memory_mb,
            env_extra=compile_env(tmp),
            import_paths=paths,
            isolation=isolation,
        )
        compile_s = time.monotonic() - t0
        clock.child_ran(res.wall_s, res.stages, warm=res.warm, zygote_start=res.zygote_start)
        if not res.ok:
            head, full = _sandbox_error(res)
            service.fail_compile(db, build_key, error=_with_hint(head, res, paths),
                                 log_text="\n".join([full, *clock.log_lines()]),
                                 timings=clock.to_json())
            return
        # Untrusted, like everything the child wrote (farm.build.child_output):
        # from here on only the worker's own copies of its bytes are used.
        taken_dir = worker_dir(zygote.work_dir())
        try:
            try:
                taken = take_artifacts(res.value, out_dir, taken_dir, names=ARTIFACT_FILES)
            except ChildOutputError as exc:
                log.warning("build %s: refused the compile child's output: %s",
                            build_key[:12], exc)
                service.fail_compile(db, build_key, error=f"refused the build's output: {exc}",
                                     log_text=f"compiled in {compile_s:.1f} s\n{exc}")
                return
            _verify_and_store(build_key, target, spec, fingerprint, taken, compile_s=compile_s,
                              paths=paths, isolation=isolation, cache=cache,
                              limits=res.limits, clock=clock)
        finally:
            shutil.rmtree(taken_dir, ignore_errors=True)


def _verify_and_store(build_key: str, target: Target, spec: JobSpec, fingerprint: str,
                      taken: list[TakenArtifact], *, compile_s: float, paths: list[str],
                      isolation: Isolation | None, cache: CacheSession | None,
                      clock: BuildTimings, limits: str = "") -> None:
    """Verify, upload and sign the worker's copies of a build's artifacts."""
    from farm.build import provenance
    from farm.build.verify import verify_artifact

    db = context.database()
    store = context.blob_store()
    s = context.settings()
    new: list[service.NewArtifact] = []
    logs: list[str] = [f"compiled in {compile_s:.1f} s; limits: {limits}"]
    failures: list[str] = []
    # Formats that compiled but failed verification: recorded on the
    # artifacts that are kept, so the job view and the resolver say so.
    verify_failed: dict[str, dict[str, str]] = {}
    for art in taken:
        _stage(db, build_key, f"verifying {art.format}")
        # Verification runs the model's code too (its factory and forward):
        # the same limits as the compile, not the verifier's generous defaults.
        waited: dict[str, float] = {}
        with clock.stage(f"verify {art.format}"):
            report = verify_artifact(
                spec,
                art.path,
                art.format,
                device=target.device,
                timeout_s=s.build_timeout_s,
                memory_mb=s.build_memory_mb,
                import_paths=paths,
                isolation=isolation,
                # The verifier checks its real module against the weights'
                # manifest, as a node will (a fake-weight build has no guards
                # on them); it, not the compile child, holds the real weights.
                weights_manifest=art.meta.get("weights_manifest"),
                zygote_start=waited,
            )
        clock.zygote_started_during(f"verify {art.format}", waited)
        logs.append(f"verify {art.format}: {report.summary()}")
        if not report.ok:
            # One format failing (say an AOTI package) must not throw away
            # another that loads and matches; the build fails only when
            # no format is left.
            failures.append(f"{art.format} artifact failed verification: {report.error}")
            verify_failed[art.format] = {
                "stage": "verify", "reason": (report.error or "").splitlines()[0][:500]}
            continue
        # Blob first, row second: a row never points at a missing blob.
        _stage(db, build_key, f"storing {art.format}")
        with (deadline(s.farm_upload_timeout_s, f"storing the {art.format} artifact"),
              clock.stage("store")):
            info = store.put_file(art.path)
        if (info.digest, info.size) != (art.sha256, art.size):
            # The copy is the worker's, read-only: something changed it after it
            # was taken. Its stored blob is not what was measured: no artifact.
            failures.append(f"{art.format} artifact changed after the worker took it "
                            f"(stored sha256 {info.digest[:12]}, taken {art.sha256[:12]})")
            # Recorded like a failed verification, so a resubmission does not
            # take the format for a deleted one and build it again each time.
            verify_failed[art.format] = {"stage": "store", "reason": failures[-1][:500]}
            continue
        new.append(
            service.NewArtifact(
                digest=info.digest,
                size=info.size,
                format=art.format,
                verified=True,
                first_call_compiles=bool(report.first_call_compiled),
                max_abs_err=report.max_abs_err,
                first_call_s=report.first_call_s,
                load_s=report.load_s,
                meta={**art.meta, "verify": report.to_json()},
                # Signed here, where it was built and verified (docs/security.md).
                attestation=provenance.attest_artifact(
                    digest=art.sha256, size=art.size, fmt=art.format,
                    build_key=build_key, fingerprint=fingerprint, spec=spec, target=target,
                    meta=art.meta, verification=report.to_json()),
            )
        )
    if not new:
        service.fail_compile(
            db,
            build_key,
            error="; ".join(failures) or "the compile produced no artifact",
            log_text="\n".join([*logs, *clock.log_lines()]),
            timings=clock.to_json(),
        )
        return
    logs += [f"dropped: {f}" for f in failures]
    if cache is not None:
        # Only a build with a verified artifact adds to the shared cache.
        with clock.stage("cache share"):
            _harvest(cache)
        logs.append(f"compile cache: {cache.stats}")
    first_meta = taken[0].meta
    outcome = first_meta.get("aot_autograd_cache")
    if outcome in ("hit", "miss", "bypass"):  # the child's word, shown as such
        logs.append(f"AOTAutograd cache (as the compile child saw it): {outcome}")
    logs += [f"{fmt} FAILED at compile: {why['reason']}"
             for fmt, why in (first_meta.get("formats_failed") or {}).items()]
    logs += [f"no {fmt}: {why}"
             for fmt, why in (first_meta.get("formats_skipped") or {}).items()]
    if verify_failed:
        for a in new:
            a.meta.setdefault("formats_failed", {}).update(verify_failed)
    logs += clock.log_lines()
    # The blobs are stored: a database blip now must not throw the build
    # away and compile it again, so the commit waits for the database
    # (bounded) before the task's own retry takes over.
    for attempt in Retrying(retry=retry_if_exception_type((DatabaseUnavailable,
                                                            OperationalError)),
                            stop=stop_after_delay(FINISH_WAIT_S),
                            wait=wait_exponential(multiplier=0.5, max=5), reraise=True):
        with attempt:
            unnamed = service.finish_compile(
                db,
                build_key,
                target=target,
                spec=spec,
                fingerprint=fingerprint,
                artifacts=new,
                compile_s=compile_s,
                log_text="\n".join(logs),
                timings=clock.to_json(),
            )
    for digest in unnamed:
        # A rebuild's replaced artifact, or a kept format's new copy: no row
        # names the blob. Left behind it is only wasted space.
        try:
            store.delete(digest)
        except Exception as exc:
            log.warning("could not delete unreferenced blob %s: %s", digest[:12], exc)


def _shared_cache(target: Target, build_dir: Path, *, model: str,
                  project: str | None = None) -> CacheSession | None:
    """The target's shared compile cache for this build, prefilled into
    ``build_dir`` (farm.build.compile_cache); None when it is off. Best
    effort: a cache that is down costs the build its speed-up, never the build."""
    s = context.settings()
    try:
        store = open_store(mode=s.farm_compile_cache, redis_url=s.redis_url,
                           farm_home=s.farm_home, url=s.farm_compile_cache_url)
        if store is None:
            return None
        salt = cache_salt(context.database(), str(target))
        # Per project by default: who can poison whose build (docs/security.md).
        ns = scoped_namespace(str(target), salt, scope=s.farm_compile_cache_scope,
                              project=project, model=model,
                              prefix=s.farm_compile_cache_prefix)
        cache = CacheSession(store, ns, build_dir)
        cache.prefill()
        return cache
    except Exception as exc:
        log.warning("no shared compile cache for %s: %s", target, exc)
        return None


def _harvest(cache: CacheSession) -> None:
    try:
        cache.harvest()
    except Exception as exc:
        log.warning("could not share this build's compile cache: %s", exc)


def _stage(db: Any, build_key: str, stage: str) -> None:
    """Tell the job view what the build does now (best effort: progress
    reporting must never fail a build)."""
    try:
        service.set_build_stage(db, build_key, stage)
    except Exception as exc:
        log.warning("could not record stage %r of %s: %s", stage, build_key[:12], exc)
