"""Per-process handles a worker needs: database, blob store, its own target.

Created lazily on first use, after Celery has forked, so no connection is
shared across processes.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

from farm.core.settings import Settings, get_settings
from farm.core.target import Target, detect_local_target
from registry.blobstore import BlobStore, open_blob_store
from registry.db import Database


@lru_cache(maxsize=1)
def database() -> Database:
    return Database(get_settings().resolved_database_url(), check=True)


@lru_cache(maxsize=1)
def blob_store() -> BlobStore:
    s = get_settings()
    url = s.resolved_blob_store_url()
    if url.startswith("s3://"):
        return open_blob_store(url, endpoint_url=s.s3_endpoint_url or None)
    return open_blob_store(url)


@lru_cache(maxsize=2)
def local_target(device: str) -> Target:
    return detect_local_target(device)


def settings() -> Settings:
    return get_settings()


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def heartbeat_max_age_s() -> float:
    # Three missed beats: one slow beat (a busy database) must not look like death.
    return 3.0 * get_settings().heartbeat_s
