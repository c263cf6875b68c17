"""The web dashboard: read-only pages under ``/ui``, rendered on the server
with Jinja2 (autoescaped: build logs and model names are user input and can
hold hostile text), plain HTML and one stylesheet; no JavaScript at all.

Authentication is the API's own. A browser signs in once at ``/ui/login``
with an API token (any role); the token is kept in an HttpOnly,
SameSite=Strict cookie scoped to ``/ui``, so page scripts cannot read it and
other sites cannot send it. ``Authorization: Bearer`` works too (curl, a
proxy). A request with neither, or with a bad token, gets the sign-in page
with 401 and no data. With ``FARM_AUTH=false`` (embedded mode) every page is
open, as the API is.

Every page reads through the service layer's views (``registry.service``),
as the JSON routes do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from farm.core.digests import InvalidDigest, validate_digest
from farm.core.target import Target, TargetError, TargetSelector
from registry import service
from registry.auth import ANONYMOUS_ADMIN, AuthError, Principal, bearer_token
from registry.service import coverage, projects, trust
from registry.service import reports as report_service

from . import dashboard_format as fmt
from .state import AppState
from .worker_stats import read_worker_table

log = logging.getLogger(__name__)

PREFIX = "/ui"
COOKIE = "farm_dashboard_token"
COOKIE_MAX_AGE_S = 12 * 3600
MAX_LOGIN_BODY = 4096
MAX_LIMIT = 500

# No scripts, no frames, no third-party anything: a log line that slips past
# the escaping still cannot run or load a thing.
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; img-src 'self' data:; "
                                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: with it a browser's form POST names its origin "null",
    # and the sign-in's same-origin check could not tell the page from a stranger.
    "Referrer-Policy": "same-origin",
    # Pages hold data behind a token: no shared or back-button cache keeps them.
    "Cache-Control": "no-store",
}

_TEMPLATES = resources.files("registry.api") / "templates" / "dashboard"
_CSS = (_TEMPLATES / "dashboard.css").read_bytes()


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("registry.api", "templates/dashboard"),
        # Everything is escaped, whatever a template's name ends with.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        duration=fmt.duration,
        when=fmt.short_time,
        bytes=fmt.human_bytes,
        json=fmt.json_text,
        flatten=fmt.flatten,
        err=fmt.error_value,
    )
    return env


templates = Jinja2Templates(env=_environment())
router = APIRouter(prefix=PREFIX, include_in_schema=False)


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.farm
    return state


def _token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        return bearer_token(header)
    return request.cookies.get(COOKIE) or None


def _principal(state: AppState, token: str | None) -> Principal | None:
    """Who ``token`` is (any role reads the dashboard), or None."""
    auth = state.auth
    if not auth.enabled:
        return ANONYMOUS_ADMIN
    if not token:
        return None
    hit, principal = auth.cached(token)
    if not hit:
        principal = auth.load(token)
    return principal


def _local_next(target: str | None) -> str:
    """Where to go after signing in: a dashboard path only (no open redirect)."""
    if target and target.startswith(PREFIX + "/") and not target.startswith("//") \
            and "\\" not in target and "\n" not in target and "\r" not in target:
        return target
    return PREFIX + "/"


def _html(request: Request, template: str, context: dict[str, Any], *,
          status: int = 200, who: Principal | None = None) -> HTMLResponse:
    response = templates.TemplateResponse(
        request, template,
        # Auth off: nobody signed in, so there is nothing to sign out of.
        {"who": who, "prefix": PREFIX, "anonymous_name": ANONYMOUS_ADMIN.name, **context},
        status_code=status)
    response.headers.update(SECURITY_HEADERS)
    return response


def _login_page(request: Request, *, status: int, message: str | None = None,
                next_path: str | None = None) -> HTMLResponse:
    response = _html(request, "login.html",
                     {"message": message, "next": _local_next(next_path)}, status=status)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


Page = Callable[[AppState, Principal], tuple[str, dict[str, Any]]]


def _page(request: Request, build: Page) -> Response:
    """Authenticate, then render what ``build(state, who)`` returns (template,
    context); a lookup that fails renders the error page with its 4xx."""
    state = _state(request)
    try:
        who = _principal(state, _token(request))
    except AuthError as exc:
        return _login_page(request, status=401, message=exc.message,
                           next_path=str(request.url.path))
    if who is None:
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return _login_page(request, status=401, next_path=here,
                           message=("sign in with an API token" if not _token(request)
                                    else "that token is invalid or revoked: sign in again"))
    try:
        template, context = build(state, who)
    except service.NotFound as exc:
        return _html(request, "error.html", {"status": 404, "message": str(exc)},
                     status=404, who=who)
    except AuthError as exc:  # a model of a project the token may not read
        return _html(request, "error.html", {"status": exc.status, "message": exc.message},
                     status=exc.status, who=who)
    except service.InvalidRequest as exc:
        return _html(request, "error.html", {"status": 422, "message": str(exc)},
                     status=422, who=who)
    return _html(request, template, context, who=who)


# --- sign in and out -------------------------------------------------------------


@router.get("/login")
def login_form(request: Request,
               next_: Annotated[str | None, Query(alias="next", max_length=2048)] = None,
               ) -> Response:
    return _login_page(request, status=200, next_path=next_)


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the token like any API request would, then keep it in the cookie."""
    body = await request.body()
    if len(body) > MAX_LOGIN_BODY:
        return _login_page(request, status=413, message="the form is too large")
    form = parse_qs(body.decode("utf-8", errors="replace"), max_num_fields=8)
    token = (form.get("token") or [""])[0].strip()
    next_path = (form.get("next") or [""])[0]
    if not _same_origin(request):
        return _login_page(request, status=403, next_path=next_path,
                           message="sign-in must come from this dashboard's own page")
    state = _state(request)
    if not token and state.auth.enabled:
        return _login_page(request, status=401, next_path=next_path,
                           message="paste an API token (farm token create NAME --role read)")
    try:
        who = await run_in_threadpool(_principal, state, token)
    except AuthError as exc:
        who, message = None, exc.message
    else:
        message = "that token is invalid or revoked"
    if who is None:
        return _login_page(request, status=401, message=message, next_path=next_path)
    response = RedirectResponse(_local_next(next_path), status_code=303)
    if state.auth.enabled:
        response.set_cookie(COOKIE, token, max_age=COOKIE_MAX_AGE_S, path=PREFIX,
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
    log.info("dashboard sign-in: %s (%s)", who.name, who.role)
    return response


@router.post("/logout")
def logout(request: Request) -> Response:
    response = RedirectResponse(PREFIX + "/login", status_code=303)
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


def _same_origin(request: Request) -> bool:
    """A browser's POST says where its page came from; one from another site is
    refused (the cookie is SameSite=Strict anyway; this also stops login CSRF).
    A client that sends neither header (curl) is not a browser to protect."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin.split("://", 1)[-1] == request.headers.get("host", "")


@router.get("/static/dashboard.css")
def stylesheet() -> Response:
    return Response(_CSS, media_type="text/css",
                    headers={"Cache-Control": "public, max-age=3600",
                             "X-Content-Type-Options": "nosniff"})


# --- pages -----------------------------------------------------------------------


def _workers(request: Request, state: AppState) -> dict[str, Any]:
    """The workers table's context: live workers, and per target what /metrics
    reports (registry.api.worker_stats, read the same way)."""
    workers = service.live_workers(state.db, max_age_s=state.heartbeat_max_age_s)
    table = read_worker_table(state.db, request.app.state.metrics.queues,
                              max_age_s=state.heartbeat_max_age_s)
    return {"workers": sorted(workers, key=lambda w: (w["kind"], w["target"] or "", w["id"])),
            "work": table}


@router.get("/")
def overview(request: Request) -> Response:
    def build(state: AppState, who: Principal) -> tuple[str, dict[str, Any]]:
        # One notion of a miss on every page: what nodes reported not getting,
        # over the period the linked misses page shows by default.
        _, since_s = _period(MISSES_PERIOD)
        return "overview.html", {
            "counts": service.counts(state.db),
            "not_served": report_service.not_served_count(state.db, since_s=since_s),
            "misses_period": MISSES_PERIOD,
            "jobs": service.list_jobs(state.db, limit=15),
            "models": _readable_models(state, who),
            **_workers(request, state),
        }

    return _page(request, build)


@router.get("/workers")
def workers(request: Request) -> Response:
    """The workers table on a page of its own: per target, tasks waiting,
    live workers, builds, failures and compile times; the live workers."""
    return _page(request, lambda state, _: ("workers.html", _workers(request, state)))


@router.get("/models")
def models(request: Request) -> Response:
    return _page(request, lambda state, who: ("models.html",
                                              {"models": _readable_models(state, who)}))


def _readable_models(state: AppState, who: Principal) -> list[dict[str, Any]]:
    return [m for m in service.list_models(state.db) if projects.may_read(who, m.get("project"))]


ModelName = Annotated[str, Path(max_length=128)]
Ref = Annotated[str, Path(max_length=64)]


@router.get("/models/{name}")
def model(request: Request, name: ModelName) -> Response:
    def build(state: AppState, who: Principal) -> tuple[str, dict[str, Any]]:
        aliases = service.list_aliases(state.db, name, history=True)  # NotFound: the 404
        projects.require_read(who, aliases.get("project"))
        found = next(m for m in service.list_models(state.db) if m["name"] == name)
        return "model.html", {"model": found, "aliases": aliases,
                              "jobs": service.list_jobs(state.db, model=name, limit=25)}

    return _page(request, build)


@router.get("/models/{name}/versions/{version}")
def version(request: Request, name: ModelName, version: Ref) -> Response:
    """A version's (or an alias's) artifacts, per target, with their attestations."""
    def build(state: AppState, who: Principal) -> tuple[str, dict[str, Any]]:
        projects.require_read(who, projects.project_of(state.db, name))
        resolved, records = service.version_candidates(state.db, name, version)
        bindings = trust.bindings_for(state.db, name, resolved, version)
        return "version.html", {
            "name": name, "ref": version, "version": resolved,
            "targets": fmt.by_target(records),
            "version_binding": fmt.decode_envelope(bindings["version"]),
            "alias_binding": (fmt.decode_envelope(bindings["alias"])
                              if bindings["alias"] is not None else None),
        }

    return _page(request, build)


@router.get("/jobs")
def jobs(request: Request,
         state_: Annotated[str | None, Query(alias="state", max_length=32)] = None,
         model: Annotated[str | None, Query(max_length=128)] = None,
         limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100) -> Response:
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        return "jobs.html", {
            "jobs": service.list_jobs(state.db, state=state_ or None, model=model or None,
                                      limit=limit),
            "states": service.JOB_STATES, "state": state_ or "", "model": model or "",
            "limit": limit,
        }

    return _page(request, build)


@router.get("/jobs/{job_id}")
def job(request: Request, job_id: Annotated[str, Path(max_length=64)]) -> Response:
    """A job: its trace, and each target's build with stage, timings, error and log."""
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        view = service.job_view(state.db, job_id)
        return "job.html", {"job": view}

    return _page(request, build)


@router.get("/artifacts/{digest}")
def artifact(request: Request, digest: Annotated[str, Path(max_length=64)]) -> Response:
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        try:
            validate_digest(digest)
        except InvalidDigest as exc:
            raise service.InvalidRequest(str(exc)) from None
        record = service.get_artifact(state.db, digest)
        return "artifact.html", {"artifact": fmt.artifact_row(record),
                                 "download": f"/v1/artifacts/{digest}/blob"}

    return _page(request, build)


# Periods a page of node reports can cover: (query value, label, seconds).
PERIODS = (("1h", "last hour", 3600.0), ("24h", "last day", 86400.0),
           ("7d", "last week", 7 * 86400.0), ("", "all time", None))
# The misses page's default period, which the overview's count covers too.
MISSES_PERIOD = "24h"


def _period(since: str | None) -> tuple[str, float | None]:
    for value, _label, seconds in PERIODS:
        if value == (since or ""):
            return value, seconds
    known = ", ".join(v or "(empty: all time)" for v, _, _ in PERIODS)
    raise service.InvalidRequest(f"unknown period {since!r}; known: {known}")


def _flush_reports(state: AppState) -> None:
    # Reports a node sent a moment ago are still in the API's batch: write
    # them first, briefly, so the page shows what the fleet just said.
    state.reports.flush(1.0)


@router.get("/misses")
def misses(request: Request,
           model: Annotated[str | None, Query(max_length=128)] = None,
           since: Annotated[str | None, Query(max_length=8)] = MISSES_PERIOD,
           limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100) -> Response:
    """What the fleet did not get: misses, guard failures and JIT fallbacks
    that nodes reported, grouped and counted, and the latest ones."""
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        period, since_s = _period(since)
        if model:
            service.list_aliases(state.db, model, history=False)  # an unknown model: 404
        _flush_reports(state)
        return "misses.html", {
            "misses": report_service.miss_summary(state.db, model=model or None,
                                                  since_s=since_s, limit=limit),
            "total": report_service.not_served_count(state.db, model=model or None,
                                                     since_s=since_s),
            "recent": report_service.list_reports(state.db, model=model or None,
                                                  since_s=since_s, limit=min(limit, 25)),
            "model": model or "", "since": period, "periods": PERIODS, "limit": limit,
        }

    return _page(request, build)


@router.get("/models/{name}/coverage")
def model_coverage(request: Request, name: ModelName,
                   version: Annotated[str | None, Query(max_length=64)] = None,
                   since: Annotated[str | None, Query(max_length=8)] = "",
                   ) -> Response:
    """Per version: what its artifacts serve, and what nodes asked for that none serves."""
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        period, since_s = _period(since)
        _flush_reports(state)
        cov = coverage.version_coverage(state.db, name, version or None, since_s=since_s)
        return "coverage.html", {"coverage": cov, "name": name, "version": version or "",
                                 "since": period, "periods": PERIODS}

    return _page(request, build)


@router.get("/plan")
def plan(request: Request,
         target: Annotated[str | None, Query(max_length=512)] = None,
         since: Annotated[str | None, Query(max_length=8)] = "") -> Response:
    """What ``farm plan --target`` would list: the builds a target needs so that
    every model and alias the fleet uses is served there (read-only: submitting
    is ``farm plan --submit``)."""
    def build(state: AppState, _: Principal) -> tuple[str, dict[str, Any]]:
        period, since_s = _period(since)
        live = service.live_targets(state.db, max_age_s=state.heartbeat_max_age_s)
        builds = None
        if target:
            try:
                selector: TargetSelector | Target = Target.parse(target)
            except TargetError:
                try:
                    selector = TargetSelector.parse(target)
                except TargetError as exc:
                    raise service.InvalidRequest(
                        f"{exc}; give a full target or a selector such as 'cpu' or "
                        "'cpu/torch=2.14.0+cpu'") from None
            _flush_reports(state)
            builds = [b.to_json() for b in
                      coverage.plan_for_target(state.db, selector, live=live, since_s=since_s)]
        return "plan.html", {"target": target or "", "builds": builds, "live": live,
                             "since": period, "periods": PERIODS}

    return _page(request, build)


def jobs_link(**query: str) -> str:
    """``/ui/jobs?...`` with only the filters given."""
    q = {k: v for k, v in query.items() if v}
    return f"{PREFIX}/jobs" + (f"?{urlencode(q)}" if q else "")


templates.env.globals["jobs_link"] = jobs_link
