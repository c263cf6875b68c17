"""The shapes of what ``FarmClient`` returns: the API's JSON, typed.

They are ``TypedDict``s, so results stay plain dicts (``json.dumps`` them,
index them) and a type checker knows their keys. ``total=False``: the farm
may add keys, and an old farm may lack new ones.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class ArtifactInfo(TypedDict, total=False):
    """One stored artifact, as resolve and the job view show it."""

    id: int
    digest: str
    size: int
    format: str  # "aoti" | "aot_compile"
    target: str
    inputs: list[str]
    grad_mode: str  # "inference" | "training"
    options: dict[str, str]
    verified: bool
    first_call_compiles: bool
    max_abs_err: float | None
    download_url: str
    version: str


class Resolved(TypedDict, total=False):
    """``resolve``'s answer: the artifact to load, the other loadable ones, and why."""

    model: str
    version: str
    ref: str | None
    artifact: ArtifactInfo
    alternatives: list[ArtifactInfo]
    why: list[str]
    key_id: str
    # Set when the farm could not be reached and the answer is the one this
    # node's cache kept from an earlier resolve (``resolved_at``).
    offline: bool
    resolved_at: str


class BuildView(TypedDict, total=False):
    id: str
    target: str
    state: str  # pending | queued | running | succeeded | reused | failed
    stage: str | None  # while running: compiling, verifying FORMAT, storing FORMAT
    stage_at: str | None
    compile_s: float | None
    artifact_bytes: int | None
    max_abs_err: float | None
    error: str | None
    log: str | None
    artifacts: list[ArtifactInfo]


class JobView(TypedDict, total=False):
    """``job``/``wait``: a job with every build."""

    id: str
    model: str
    version: str
    state: str  # queued | tracing | compiling | succeeded | failed | partial
    spec: dict[str, Any]
    error: str | None
    log: str | None
    trace_s: float | None
    param_count: int | None
    created_at: str
    updated_at: str
    builds: list[BuildView]


class BuildSummary(TypedDict, total=False):
    target: str
    state: str
    stage: str | None


class JobSummary(TypedDict, total=False):
    """``jobs``: one line of the job list."""

    id: str
    model: str
    version: str
    state: str
    inputs: str
    grad_mode: str
    submitted_by: str | None
    created_at: str
    updated_at: str
    error: str | None
    builds: list[BuildSummary]


class AliasNow(TypedDict):
    alias: str
    version: str | None
    updated_at: str | None


class AliasEvent(TypedDict):
    alias: str
    version: str | None  # None: deleted
    previous: str | None
    actor: str | None
    project: NotRequired[str | None]  # the model's project when it moved
    at: str


class AliasList(TypedDict, total=False):
    model: str
    project: str
    aliases: list[AliasNow]
    history: list[AliasEvent]


class Deleted(TypedDict, total=False):
    """What a delete removed."""

    model: str
    version: str
    digest: str
    versions: list[str]
    aliases: list[str]
    jobs: int
    artifacts: list[str]
    blobs: list[str]
    blobs_not_deleted: list[str]


class TokenInfo(TypedDict):
    name: str
    role: str
    revoked: bool
    projects: NotRequired[dict[str, str]]  # project -> reader | maintainer | owner
    created_at: str
