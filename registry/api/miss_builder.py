"""Build on miss: turn stored miss reports of a model with the policy on into jobs.

Runs in the report sink's thread, after a batch is written, never on a
request. A miss goes through, in order: the model's policy (cached for a few
seconds), this process's gate per distinct miss (a herd's repeats stop
here), ``decide`` (a known version; nothing serves the node now; a live
compile worker builds what would load on it), the database's record of miss
builds (one job per miss, unless it failed), the model's rate limit (one
build per ``min_interval_s``, shared by every replica), and then the same
submission path as ``POST /v1/jobs`` (``accept_job``): the job is checked,
its version binding signed, and its builds deduplicated by build key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from farm.core.inputs import parse_input_list
from farm.core.specs import GradMode, SpecError
from farm.core.target import Target, TargetError
from registry import service
from registry.service import coverage
from registry.service import miss_builds as mb

from .state import AppState

log = logging.getLogger(__name__)

SUBMITTER = "build-on-miss"
POLICY_TTL_S = 5.0


class MissBuilder:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.default_interval_s = state.settings.farm_miss_build_interval_s
        self.gate = mb.RateGate(self.default_interval_s)
        self._policies: tuple[float, dict[str, float]] = (0.0, {})
        self.submitted: list[str] = []

    def policies(self) -> dict[str, float]:
        at, cached = self._policies
        if time.monotonic() - at < POLICY_TTL_S:
            return cached
        fresh = mb.policies_on(self.state.db)
        self._policies = (time.monotonic(), fresh)
        return fresh

    def forget_policies(self) -> None:
        """A policy changed in this process: read it again at the next miss."""
        self._policies = (0.0, {})

    def __call__(self, rows: Sequence[dict[str, Any]]) -> None:
        misses = [r for r in rows if r["kind"] in mb.MISS_KINDS]
        if not misses:
            return
        policies = self.policies()
        for r in misses:
            interval = policies.get(r["model"])
            if interval is None:
                continue
            key = (r["model"], r.get("ref"), r.get("version"), r["inputs"], r["grad_mode"],
                   r["target"])
            if not self.gate.allow(key, interval):
                continue
            try:
                self._one(r, interval)
            except Exception as exc:
                log.warning("build on miss for %s: %s: %s", r["model"], type(exc).__name__,
                            exc)

    def _one(self, r: dict[str, Any], interval: float) -> str | None:
        db = self.state.db
        model = r["model"]
        try:
            inputs = parse_input_list(r["inputs"])
            node = Target.parse(r["target"])
            mode = GradMode(r["grad_mode"])
        except (SpecError, TargetError, ValueError):
            return None
        try:
            version, records = service.version_candidates(db, model, r.get("version")
                                                          or r.get("ref"))
        except service.NotFound:
            return None
        live = service.live_targets(db, max_age_s=self.state.heartbeat_max_age_s)
        build, why = mb.decide(model=model, version=version, inputs=inputs, grad_mode=mode,
                               node=node, records=records, live=live)
        if build is None:
            log.info("build on miss: %s@%s %s on %s: no build (%s)", model, version,
                     r["inputs"], node, why)
            return None
        if mb.already_claimed(db, build):
            return None
        if not mb.take_slot(db, model, interval):
            log.info("build on miss: %s rate-limited (one build per %.0f s)", model, interval)
            return None
        if not mb.claim(db, build):
            return None
        base = coverage.base_spec(db, model, version)
        if base is None:
            mb.set_claim_job(db, build, None)
            return None
        spec = replace(base, inputs=build.inputs, grad_mode=build.grad_mode,
                       targets=(str(build.target),))
        # Imported here: the jobs router imports this package's state, and
        # the submission path lives with it.
        from .jobs import accept_job

        try:
            job_id, _, _ = accept_job(self.state, spec, submitted_by=SUBMITTER)
        except Exception:
            mb.set_claim_job(db, build, None)
            raise
        mb.set_claim_job(db, build, job_id)
        self.submitted.append(job_id)
        log.info("build on miss: %s@%s %s on %s: job %s", model, version, r["inputs"],
                 build.target, job_id)
        return job_id
