"""SQL schema (SQLAlchemy 2). Alembic migrations in ``migrations/`` must match it.

Identity rules that the constraints enforce:
- one artifact per (build_key, format); the build key hashes fingerprint,
  input specs, grad mode, options and target (``farm.core.specs.build_key``), so a
  duplicate artifact for the same inputs and target cannot exist;
- one blob digest may back several artifact rows only if their build keys
  differ (the bytes are content-addressed, the rows are not);
- one build per (job, target).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    event,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from farm.core import specs

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that is aware and in UTC on every backend.

    SQLite has no time zone type: it drops the offset on write and hands back
    naive values, so ``utcnow() - row.last_seen`` would raise there and work on
    PostgreSQL. Naive values written by callers are taken as UTC.
    """

    impl = DateTime
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(timezone=True)

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


DEFAULT_PROJECT = specs.DEFAULT_PROJECT
PROJECT_ROLES: tuple[str, ...] = ("reader", "maintainer", "owner")


class Project(Base):
    """A team's namespace: it owns models, and tokens hold roles in it
    (``ProjectRole``). Admins create projects; migration 0009 put every model
    made before projects into ``default``."""

    __tablename__ = "projects"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ProjectRole(Base):
    """A token holder's role in one project: ``reader`` (resolve, read),
    ``maintainer`` (+ add versions, move aliases), ``owner`` (+ grant and
    revoke roles). Keyed by the token's name, as revocation is."""

    __tablename__ = "project_roles"
    __table_args__ = (UniqueConstraint("project", "principal"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project: Mapped[str] = mapped_column(ForeignKey("projects.name", ondelete="CASCADE"))
    principal: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[str] = mapped_column(String(16))
    granted_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Model(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    project: Mapped[str] = mapped_column(ForeignKey("projects.name"), index=True,
                                         default=DEFAULT_PROJECT)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    versions: Mapped[list[ModelVersion]] = relationship(back_populates="model")


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    version: Mapped[str] = mapped_column(String(64))
    entrypoint: Mapped[str] = mapped_column(String(512))
    kwargs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    kind: Mapped[str] = mapped_column(String(16), default="factory")
    # sha256 of the code pack the version's code travels in (farm.core.codepack);
    # None: code installed on the workers (farm.zoo).
    code_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    model: Mapped[Model] = relationship(back_populates="versions")


class Alias(Base):
    """A named pointer at a version, e.g. ``prod`` -> 1.4.2."""

    __tablename__ = "aliases"
    __table_args__ = (UniqueConstraint("model_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"))
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime(), default=utcnow, onupdate=utcnow
    )


class AliasEvent(Base):
    """Every move of an alias, kept: the history a rollback reads.

    Names, not ids: the history outlives a deleted version or alias."""

    __tablename__ = "alias_events"
    __table_args__ = (Index("ix_alias_events_model_alias", "model", "alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    alias: Mapped[str] = mapped_column(String(64))
    # None: the alias was deleted.
    version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    previous: Mapped[str | None] = mapped_column(String(64), nullable=True)
    actor: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # The model's project when it moved (None: before projects existed).
    project: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    inputs: Mapped[str] = mapped_column(Text)  # canonical, farm.core.specs.format_inputs
    grad_mode: Mapped[str] = mapped_column(String(16))
    options: Mapped[str] = mapped_column(Text)  # canonical JSON
    # The spec's code_digest as a column, for queries and the trace sharing.
    code_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # queued -> tracing -> compiling -> succeeded | failed | partial
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    param_count: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    param_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    flops: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    trace_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Calls of repeated blocks (transformer layers) the trace found: where a
    # per-block build would help (farm.core.hints). None: not traced yet.
    repeated_blocks: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The worker tracing it (its heartbeat id): the sweep re-sends the trace
    # as soon as that worker's heartbeat stops, not after the trace time limit.
    trace_worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    log: Mapped[str | None] = mapped_column(Text, nullable=True)
    submitted_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # `farm submit --rebuild`: compile even where the build key has artifacts
    # (they are replaced); without it only a format missing from them is built.
    rebuild: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime(), default=utcnow, onupdate=utcnow
    )

    builds: Mapped[list[Build]] = relationship(back_populates="job", order_by="Build.target")


class Build(Base):
    """One job's work for one target."""

    __tablename__ = "builds"
    __table_args__ = (UniqueConstraint("job_id", "target"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    target: Mapped[str] = mapped_column(String(512))
    build_key: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    # The code pack this build runs (its job's), for provenance statements.
    code_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # pending (waiting on trace) -> queued -> running -> succeeded | failed | reused
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    compile_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    artifact_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    verified: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    max_abs_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_call_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_call_compiles: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    log: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Where a finished build's seconds went ({"worker": {stage: s}, "child":
    # {stage: s}, "warm": bool}; workers.build_timings): the job page's table.
    timings: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # What a running build is doing now (compiling, verifying aoti, storing),
    # and since when: a build takes minutes, and `farm status` says which part.
    stage: Mapped[str | None] = mapped_column(String(64), nullable=True)
    stage_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    job: Mapped[Job] = relationship(back_populates="builds")


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (
        UniqueConstraint("build_key", "format"),
        Index("ix_artifacts_lookup", "fingerprint", "device", "torch_version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    format: Mapped[str] = mapped_column(String(16))
    build_key: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(64))
    inputs: Mapped[str] = mapped_column(Text)
    grad_mode: Mapped[str] = mapped_column(String(16))
    options: Mapped[str] = mapped_column(Text)
    target: Mapped[str] = mapped_column(String(512))
    # The target's fields as columns, so operators can query them and the
    # resolver's inputs are visible in SQL.
    device: Mapped[str] = mapped_column(String(16))
    gpu_name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    capability: Mapped[str | None] = mapped_column(String(16), nullable=True)
    torch_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str | None] = mapped_column(String(16), nullable=True)
    python_version: Mapped[str] = mapped_column(String(16))
    cuda_version: Mapped[str | None] = mapped_column(String(16), nullable=True)
    cpu_isa: Mapped[str | None] = mapped_column(String(32), nullable=True)
    threads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The C++ compiler the build ran (path and --version; farm.build.toolchain)
    # and, for an AOTI package, the GLIBCXX_/CXXABI_ symbol versions its .so
    # needs: a node whose libstdc++ lacks one cannot load it.
    cxx: Mapped[str | None] = mapped_column(String(256), nullable=True)
    libstdcxx_needs: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=list)
    verified: Mapped[bool] = mapped_column(Boolean, default=False)
    first_call_compiles: Mapped[bool] = mapped_column(Boolean, default=False)
    max_abs_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_call_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    load_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The build statement (DSSE envelope, JSON) the compile worker signed when
    # the artifact passed verification; None for rows no builder attested.
    attestation: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Its sha256: a resolve answer names the statement by it and the node
    # fetches it from /v1/attestations/<digest> (set by attestation_digest below).
    attestation_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True,
                                                           index=True)
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


@event.listens_for(Artifact, "before_insert")
@event.listens_for(Artifact, "before_update")
def attestation_digest(_mapper: Any, _connection: Any, row: Artifact) -> None:
    """Keep ``attestation_sha256`` the digest of ``attestation``, whoever writes the row."""
    row.attestation_sha256 = (None if row.attestation is None
                              else hashlib.sha256(row.attestation.encode()).hexdigest())


class ReadModelGeneration(Base):
    """One row (id 1) counting the transactions that changed what a resolve
    reads; database triggers (migration 0010) bump it. The API's read model
    polls it while its change notifications are down (``registry.api.read_model``)."""

    __tablename__ = "read_model_generation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)


class VersionArtifact(Base):
    """Which artifacts serve which model version (an artifact may serve several:
    two versions with the same graph share their builds)."""

    __tablename__ = "version_artifacts"
    __table_args__ = (UniqueConstraint("version_id", "artifact_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"))
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"),
                                             index=True)


class CompileClaim(Base):
    """At most one compile in flight per build key.

    Whoever inserts the row (the primary key makes that atomic on PostgreSQL
    and SQLite alike) enqueues the compile task; every other build with the
    same key waits for that task, which finishes them all. A failed claim can
    be taken again by a later job.
    """

    __tablename__ = "compile_claims"

    build_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    target: Mapped[str] = mapped_column(String(512))
    # queued -> running -> succeeded | failed
    state: Mapped[str] = mapped_column(String(16), default="queued")
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime(), default=utcnow, onupdate=utcnow
    )


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the token
    role: Mapped[str] = mapped_column(String(16))  # read | submit | admin
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class WorkerHeartbeat(Base):
    """Live workers: a compile worker registers its target here on start and
    refreshes ``last_seen``; a target is live while a recent heartbeat exists."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)  # hostname:pid
    kind: Mapped[str] = mapped_column(String(16))  # trace | compile
    target: Mapped[str | None] = mapped_column(String(512), nullable=True)
    queue: Mapped[str] = mapped_column(String(600))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class ResolveMiss(Base):
    """A fleet node asked for something the farm could not serve."""

    __tablename__ = "resolve_misses"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    inputs: Mapped[str] = mapped_column(Text)
    grad_mode: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(512))
    reasons: Mapped[list[Any]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SigningKey(Base):
    """A public key an admin enrolled: a builder's (signs builds) or the API's
    name key (signs names). What nodes trust is the root-signed trust list,
    not this table: a row here only says what the next list should contain."""

    __tablename__ = "signing_keys"

    keyid: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the raw key
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))  # builder | names
    public_key: Mapped[str] = mapped_column(Text)  # PEM
    enrolled_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    enrolled_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class TrustListRow(Base):
    """A trust list as the admin signed it offline (DSSE envelope, JSON)."""

    __tablename__ = "trust_lists"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    envelope: Mapped[str] = mapped_column(Text)
    root_keyid: Mapped[str] = mapped_column(String(64))
    uploaded_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class NameBinding(Base):
    """A name statement the API signed when it accepted the request that made
    it: ``kind`` "version" (model@version is this program) or "alias"
    (model@alias points at ``version``). Served as stored, never re-signed."""

    __tablename__ = "name_bindings"
    __table_args__ = (UniqueConstraint("model", "kind", "ref"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))
    ref: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    envelope: Mapped[str] = mapped_column(Text)
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class NodeReport(Base):
    """What a fleet node did with the farm's answer: a miss, a guard failure,
    a JIT fallback or a load (farm.node's reporter sends them in batches).
    Telemetry, written in bulk off the request path: a few may be lost in a
    crash, and ``reported_at`` is the node's clock, ``received_at`` the API's."""

    __tablename__ = "node_reports"
    __table_args__ = (Index("ix_node_reports_model_kind_received", "model", "kind",
                            "received_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    reported_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    kind: Mapped[str] = mapped_column(String(16))  # miss | guard_failure | fallback | load
    model: Mapped[str] = mapped_column(String(128))
    ref: Mapped[str | None] = mapped_column(String(64), nullable=True)
    version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    inputs: Mapped[str] = mapped_column(Text)
    grad_mode: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(512))
    format: Mapped[str | None] = mapped_column(String(32), nullable=True)
    digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    code: Mapped[str | None] = mapped_column(String(32), nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    node: Mapped[str | None] = mapped_column(String(256), nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


class ModelPolicy(Base):
    """Per-model fleet policy: whether a reported miss starts a build, and how
    often (``min_interval_s``) such builds may start; ``last_build_at`` is the
    rate limit's state, taken with a conditional UPDATE so every API replica
    agrees on it."""

    __tablename__ = "model_policies"

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    build_on_miss: Mapped[bool] = mapped_column(Boolean, default=False)
    min_interval_s: Mapped[float] = mapped_column(Float, default=60.0)
    last_build_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class MissBuild(Base):
    """A job started because nodes missed (build on miss): one per
    (model, version, inputs, grad mode, target), so a herd of nodes that
    misses the same way starts one job."""

    __tablename__ = "miss_builds"
    __table_args__ = (UniqueConstraint("model", "version", "inputs", "grad_mode", "target"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    inputs: Mapped[str] = mapped_column(String(2048))
    grad_mode: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(512))
    job_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class CacheSalt(Base):
    """The salt of a target's shared compile cache (``farm.build.compile_cache``):
    part of every entry's namespace, so a new salt disowns every entry written
    before it (REAPI's cache salt). No row: the target's first salt, ``"0"``."""

    __tablename__ = "cache_salts"

    target: Mapped[str] = mapped_column(String(512), primary_key=True)
    salt: Mapped[str] = mapped_column(String(64))
    updated_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
