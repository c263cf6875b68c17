"""What an uncached resolve reads, in one transaction and as few round trips
as the question allows.

A fleet asking 10,000 different questions (bench/registry_load.py
--distinct) misses the API's caches on every one, and on a loaded database
host each round trip costs milliseconds: the common question, an explicit
version, is answered by one statement (model, version and its artifacts
joined) and the name statements by a second, in one session. Other refs
(an alias, none, an unknown name) take the general path, which says exactly
what is missing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from registry import models as m
from registry.convert import artifact_to_record
from registry.db import Database
from registry.entities import ArtifactRecord
from registry.service.trust import bindings_for, bindings_in
from registry.service.views import version_candidates


def candidates_and_bindings(db: Database, name: str, ref: str | None
                            ) -> tuple[str, list[ArtifactRecord], dict[str, Any]]:
    """(version, its artifacts, the name statements a resolve of ``ref`` serves);
    ``NotFound`` as ``version_candidates`` raises it."""
    if ref is not None:
        with db.session() as s:
            rows = s.execute(
                select(m.ModelVersion.version, m.Artifact)
                .select_from(m.Model)
                .join(m.ModelVersion, m.ModelVersion.model_id == m.Model.id)
                .outerjoin(m.VersionArtifact, m.VersionArtifact.version_id == m.ModelVersion.id)
                .outerjoin(m.Artifact, m.Artifact.id == m.VersionArtifact.artifact_id)
                .where(m.Model.name == name, m.ModelVersion.version == ref)).all()
            if rows:
                version = rows[0][0]
                records = [artifact_to_record(a) for _, a in rows if a is not None]
                return version, records, bindings_in(s, name, version, ref)
    version, records = version_candidates(db, name, ref)
    return version, records, bindings_for(db, name, version, ref)
