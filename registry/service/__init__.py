"""The farm's state machine over SQL: jobs, builds, compile claims, artifacts.

The HTTP API and the Celery tasks both call these functions; neither touches
ORM rows directly. Every function runs in one transaction, so a crash between
two calls leaves the database in a state the next call (or a redelivered
task) can continue from.

Job:    queued -> tracing -> compiling -> succeeded | failed | partial
Build:  pending -> queued -> running -> succeeded | reused | failed
Claim:  queued -> running -> succeeded | failed     (one per build key)

This package is that state machine, one module per stage; callers use it as
``service.<function>`` through the names below.
"""

from registry.service.builds import (
    ClaimDecision,
    NewArtifact,
    begin_compile,
    fail_compile,
    finish_compile,
    release_claim,
)
from registry.service.common import (
    LOG_LIMIT,
    TERMINAL_BUILD_STATES,
    Clash,
    InvalidRequest,
    NotFound,
)
from registry.service.fleet import (
    choose_targets,
    live_targets,
    live_workers,
    record_heartbeat,
    remove_worker,
)
from registry.service.jobs import (
    CompileDispatch,
    fail_job,
    job_spec,
    record_trace,
    record_trace_for_identical,
    requeue_stale_claims,
    requeue_stale_jobs,
    start_trace,
    submit_job,
    version_rebind_blocker,
)
from registry.service.lifecycle import (
    JOB_STATES,
    Deleted,
    delete_alias,
    delete_artifact,
    delete_model,
    delete_version,
    list_aliases,
    list_jobs,
    set_build_stage,
)
from registry.service.views import (
    build_stats_by_target,
    counts,
    get_artifact,
    job_view,
    list_models,
    record_miss,
    set_alias,
    version_candidates,
)

__all__ = [
    "JOB_STATES",
    "LOG_LIMIT",
    "TERMINAL_BUILD_STATES",
    "ClaimDecision",
    "Clash",
    "CompileDispatch",
    "Deleted",
    "InvalidRequest",
    "NewArtifact",
    "NotFound",
    "begin_compile",
    "build_stats_by_target",
    "choose_targets",
    "counts",
    "delete_alias",
    "delete_artifact",
    "delete_model",
    "delete_version",
    "fail_compile",
    "fail_job",
    "finish_compile",
    "get_artifact",
    "job_spec",
    "job_view",
    "list_aliases",
    "list_jobs",
    "list_models",
    "live_targets",
    "live_workers",
    "record_heartbeat",
    "record_miss",
    "record_trace",
    "record_trace_for_identical",
    "release_claim",
    "remove_worker",
    "requeue_stale_claims",
    "requeue_stale_jobs",
    "set_alias",
    "set_build_stage",
    "start_trace",
    "submit_job",
    "version_candidates",
    "version_rebind_blocker",
]
