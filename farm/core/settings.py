"""Configuration: environment variables only, one table in the README.

With nothing set the farm is embedded: SQLite, a local blob directory and a
broker on SQLite (kombu's SQLAlchemy transport), all under ``FARM_HOME``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(os.environ.get("FARM_HOME", Path.home() / ".farm"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", case_sensitive=False)

    farm_home: Path = Field(default_factory=default_home)
    database_url: str = ""  # default: sqlite under farm_home
    # A file holding the database password (a docker secret): put into
    # DATABASE_URL, which then names no password of its own.
    database_password_file: str = ""
    broker_url: str = ""  # default: REDIS_URL, else SQLite broker under farm_home
    redis_url: str = ""
    blob_store_url: str = ""  # default: file:// under farm_home
    # S3 endpoint for MinIO / moto; empty means AWS's own.
    s3_endpoint_url: str = ""
    # Trust (docs/security.md). The API's name key (a path to a private PEM
    # file): it signs model names, versions and aliases when the request that
    # sets them is accepted; created under FARM_HOME only in embedded mode.
    farm_name_key: str = ""
    # A compile worker's builder key (a path to a private PEM file, 0600): it
    # signs the provenance of what the worker built and verified.
    farm_builder_key: str = ""
    # The farm's root public key (PEM text or a path) that signs the trust list
    # of builder and name keys: nodes pin it; the API checks uploads with it.
    # Unset on a node: trusted on first use, for a loopback farm only.
    farm_root_key: str = ""
    # A node refuses plain http to a host that is not loopback unless this is set.
    farm_allow_http: bool = False
    # CA bundle a node verifies the API's TLS certificate with (default: certifi's).
    farm_ca_bundle: str = ""
    # TLS for `farm serve` (uvicorn's ssl_certfile / ssl_keyfile).
    farm_tls_cert: str = ""
    farm_tls_key: str = ""
    farm_url: str = "http://127.0.0.1:8000"
    farm_token: str = ""
    # Bootstrap admin token accepted by the API (hashed in memory); for first setup.
    farm_admin_token: str = ""
    # The same, read from a file (a docker secret) when FARM_ADMIN_TOKEN is unset.
    farm_admin_token_file: str = ""
    # Embedded mode turns auth off only when explicitly asked.
    farm_auth: bool = True
    # Limits for model code run by workers. BUILD_MEMORY_MB: what one build
    # child may use (PSS of its processes plus its /tmp and /dev/shm; a cgroup's
    # memory.max where FARM_BUILD_CGROUP is set); 0: half this machine's
    # memory, at least 8 GB (farm.build.memory_budget).
    build_timeout_s: int = 900
    build_memory_mb: int = 0
    trace_timeout_s: int = 300
    # How build children run model code (farm.build.sandbox): "on" (isolated
    # in namespaces as FARM_SANDBOX_UID; a worker that cannot isolate refuses
    # to start), "auto" (isolated when possible: the embedded farm's default),
    # "off" (development only: unisolated, a warning at every build).
    farm_sandbox: str = "on"
    farm_sandbox_uid: int = 65534
    # A root worker gives each build child running on the host at once a uid
    # of its own, FARM_SANDBOX_UID_BASE and up (farm.build.uid_slots), so the
    # per-uid process limit, BUILD_MAX_PROCS, is per build; FARM_SANDBOX_UIDS=0
    # runs every build as FARM_SANDBOX_UID.
    farm_sandbox_uid_base: int = 60100
    farm_sandbox_uids: int = 64
    build_max_procs: int = 2048
    # A cgroup v2 directory delegated to the farm (farm.build.cgroup_limits):
    # each build child gets a child cgroup with memory.max and pids.max, the
    # kernel's limits; empty: the PSS watchdog is the memory limit.
    farm_build_cgroup: str = ""
    # Build children forked from a warm, sandboxed zygote that has imported
    # torch, Dynamo and Inductor (farm.build.zygote): "on", or "off" (every
    # child a new interpreter).
    farm_build_zygote: str = "on"
    # A build zygote compiles a small sample before it serves, once per
    # zygote, so that no child pays Dynamo's, AOTAutograd's and Inductor's
    # first use (cost and gain: bench/zygote_warm_up.py, docs/configuration.md).
    # Off: a worker that builds once or twice in its life (a test's) saves it.
    farm_zygote_warm_up: bool = True
    # Largest code pack `farm submit` uploads and the API accepts (bytes).
    code_pack_max_bytes: int = 64 * 1024**2
    # Where a build worker's pip finds the pins of `farm submit --requirements`
    # (wheels only): an index URL (default: pip's own configuration, PyPI) and
    # a directory or URL of wheels; find-links alone means no index at all.
    farm_pip_index_url: str = ""
    farm_pip_find_links: str = ""
    max_body_bytes: int = 1_000_000
    # uvicorn's per-request access log ("off" halves the CPU of a cached resolve).
    farm_access_log: bool = True
    heartbeat_s: int = 10
    # A file a worker touches after every heartbeat it records: a container
    # healthcheck reads its age (docker-compose.yml). Empty: none.
    farm_worker_alive_file: str = ""
    # Limits of the parts of a task that run outside the sandbox: fetching
    # and installing a job's code pack and its wheels, and storing one
    # artifact in the blob store. Past one, the task is retried.
    farm_code_fetch_timeout_s: float = 600.0
    farm_upload_timeout_s: float = 600.0
    # Redis redelivers a task nobody acked after this long. None: the longest
    # task's worst case from the limits above plus a margin
    # (workers.timing.visibility_timeout_s), so a task is never redelivered
    # while it still runs.
    farm_visibility_timeout_s: int | None = None
    # How often an idle worker scans Redis for messages past the visibility
    # timeout (kombu's restore). None: kombu's default (about every 100 s).
    farm_unacked_restore_s: float | None = None
    # How long a job or claim may sit queued before the sweep assumes its
    # message was lost (the broker was down, or restarted without persistence)
    # and sends it again. A duplicate is harmless but not free: keep this above
    # the longest wait in the queue.
    farm_requeue_after_s: float = 900.0
    # Keep coordinate-descent tuning in max-autotune builds (their first call
    # then tunes on every node; farm.build.compile_common.mode_options says why not).
    farm_coordesc: bool = False
    # AOTI packages beside the aot_compile artifacts (where they apply and
    # load). FARM_AOTI=0: a farm whose nodes all run Python skips them, and
    # with them the larger part of a CPU build (bench/compiler_handoff.py: the
    # AOTI package is 18 of a small MLP's 29 s on 2 cores).
    farm_aoti: bool = True
    # Which compile workers `farm serve --embedded` starts beside the API,
    # comma separated: this machine's CPU target by default, "cuda" (or
    # "cpu,cuda") on a GPU host. A device named twice ("cuda,cuda") gets two
    # compile workers that build that target's jobs side by side.
    farm_embedded_devices: str = "cpu"
    # Shared compile caches per target (farm.build.compile_cache): "on" (the
    # farm's Redis, else a directory under FARM_HOME), "redis", "dir", "off".
    # The prefix namespaces the keys, so farms sharing one Redis never share
    # entries.
    farm_compile_cache: str = "on"
    farm_compile_cache_prefix: str = "farm:ccache"
    # Where the store is, when not the farm's own: a redis:// URL (a Redis
    # kept for kernels, apart from the broker's) or a directory several farms
    # of one host share. Empty: REDIS_URL, else FARM_HOME/compile-cache.
    farm_compile_cache_url: str = ""
    # Who shares a target's compile cache (farm.build.compile_cache.SCOPES):
    # "project" (default) only builds of one project; "model" only builds of
    # one model; "target" every build of the target, across projects (one
    # project's build can then plant a kernel another project's artifact
    # ships: an admin's explicit choice, docs/security.md).
    farm_compile_cache_scope: str = "project"
    client_cache_dir: Path | None = None
    client_cache_max_bytes: int = 10 * 1024**3
    # Node reports (farm.node.reports): off with FARM_REPORTS=0; sent every
    # FARM_REPORT_INTERVAL_S seconds (or sooner, when a batch fills).
    farm_reports: bool = True
    farm_report_interval_s: float = 5.0
    # Build on miss: how long after one build a miss of the same model may
    # start the next (a model's own policy may say longer).
    farm_miss_build_interval_s: float = 60.0
    # How stale (seconds) the API's resolve caches may be: a version's artifact
    # list and whole resolve answers. 0 turns both off (bench/registry_load.py
    # --distinct measures that: every resolve reads the database).
    farm_resolve_cache_s: float = 1.0
    # How often an API process polls the read model's generation while its
    # PostgreSQL change notifications are down (registry.api.read_model).
    farm_read_model_poll_s: float = Field(default=1.0, gt=0, le=60)

    @model_validator(mode="after")
    def _read_secret_files(self) -> Settings:
        # Docker secrets are files: the values are read once, here, so the
        # rest of the farm sees them as if they had been set directly.
        if self.farm_admin_token_file and not self.farm_admin_token:
            self.farm_admin_token = _read_secret(self.farm_admin_token_file)
        if self.database_password_file and self.database_url:
            self.database_url = with_password(
                self.database_url, _read_secret(self.database_password_file)
            )
        return self

    def embedded_devices(self) -> tuple[str, ...]:
        return tuple(d.strip() for d in self.farm_embedded_devices.split(",") if d.strip())

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.farm_home / 'farm.db').resolve()}"

    def resolved_broker_url(self) -> str:
        if self.broker_url:
            return self.broker_url
        if self.redis_url:
            return self.redis_url
        return f"sqla+sqlite:///{(self.farm_home / 'broker.db').resolve()}"

    def resolved_blob_store_url(self) -> str:
        return self.blob_store_url or (self.farm_home / "blobs").resolve().as_uri()

    def resolved_cache_dir(self) -> Path:
        return self.client_cache_dir or (self.farm_home / "cache")


def _read_secret(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the secret file {path}: {exc.strerror}") from None


def with_password(url: str, password: str) -> str:
    """``url`` (scheme://user@host/...) with ``password`` for its user."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        raise ValueError(
            "DATABASE_PASSWORD_FILE needs a DATABASE_URL with a user "
            "(postgresql+psycopg://USER@HOST/DB)"
        )
    user = netloc.rsplit("@", 1)[0].split(":", 1)[0]
    host = netloc.rsplit("@", 1)[1]
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}{slash}{path}"


# Settings a build's sandboxed children (trace, compile, verify) read
# themselves: the sandbox passes these through while it scrubs the rest.
CHILD_SETTINGS = frozenset({"farm_coordesc"})


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
