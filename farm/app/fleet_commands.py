"""The fleet-feedback commands: misses, a model's status, coverage, policy, plan."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from farm.app.console import EXIT_OK, CommandFailed, _print_json, _short_target, answer
from farm.app.subcommands import arg, command, farm_client, group


def _client(args: argparse.Namespace) -> Any:
    # A command reads the farm; it reports nothing of its own.
    return farm_client(args, reports=False)


def _when(text: Any) -> str:
    return str(text or "")[:19].replace("T", " ")


def _miss_lines(rows: list[dict[str, Any]], *, with_model: bool) -> list[str]:
    out = []
    for r in rows:
        what = f"{r['model']}@{r.get('version') or r.get('ref') or 'latest'}  " \
            if with_model else f"@{r.get('version') or r.get('ref') or 'latest'}  "
        out.append(f"{r['count']:>6}  {r['kind']:<13} {what}{r['inputs']} ({r['grad_mode']})  "
                   f"on {_short_target(str(r['target']))}  [{r.get('code') or '-'}]  "
                   f"{r.get('nodes', 0)} node(s), last {_when(r.get('last_at'))}")
        if r.get("reason"):
            out.append(f"        {str(r['reason'])[:160]}")
    return out


def _misses_lines(rows: list[dict[str, Any]], *, model: str | None) -> Iterator[str]:
    if not rows:
        yield "no misses reported" + (f" for {model}" if model else "")
        return
    yield f"{'count':>6}  {'kind':<13} what"
    yield from _miss_lines(rows, with_model=True)


def cmd_misses(args: argparse.Namespace) -> int:
    body = _client(args).misses(args.model, since_s=args.since, limit=args.limit)
    return answer(args, body, lambda b: _misses_lines(b.get("misses") or [], model=args.model))


def _model_status_lines(name: str, model: dict[str, Any], reports: dict[str, Any],
                        policy: dict[str, Any]) -> Iterator[str]:
    aliases = model.get("aliases") or {}
    yield f"{name}  build on miss: {'on' if policy.get('build_on_miss') else 'off'}"
    for v in model.get("versions") or []:
        tags = [a for a, ver in sorted(aliases.items()) if ver == v.get("version")]
        yield (f"  {v.get('version')}: {v.get('artifacts')} artifact(s)"
               + (f"  ({', '.join(tags)})" if tags else ""))
    counts = reports.get("counts") or {}
    yield "node reports: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in
                                       ("load", "miss", "guard_failure", "fallback"))
    misses = reports.get("misses") or []
    if misses:
        yield "misses:"
        yield from ("  " + line for line in _miss_lines(misses, with_model=False))
    for b in policy.get("miss_builds") or []:
        yield (f"built on miss: {b['version']} {b['inputs']} on {_short_target(b['target'])} "
               f"-> job {str(b.get('job_id') or '?')[:8]}")


def model_status(args: argparse.Namespace, name: str) -> int:
    """``farm status MODEL``: versions, aliases, what nodes reported, top misses."""
    client = _client(args)
    models = client.models()
    model = next((m for m in models if m.get("name") == name), None)
    if model is None:
        import difflib

        close = difflib.get_close_matches(name, [str(m.get("name")) for m in models], n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise CommandFailed(f"no job or model {name!r}: {hint}`farm jobs` and `farm models` "
                            "list them")
    reports = client.model_reports(name, since_s=getattr(args, "since", None))
    status = {"model": model, "reports": reports, "policy": client.policy(name)}
    return answer(args, status, lambda s: _model_status_lines(name, **s))


def _coverage_lines(name: str, body: dict[str, Any]) -> Iterator[str]:
    for v in body.get("versions") or []:
        tags = f"  ({', '.join(v['aliases'])})" if v.get("aliases") else ""
        yield f"{name}@{v['version']}{tags}"
        if not v.get("covers"):
            yield "  covers nothing yet (no artifacts)"
        for c in v.get("covers") or []:
            opts = ",".join(f"{k}={val}" for k, val in sorted(c["options"].items()))
            yield (f"  {c['inputs']} ({c['grad_mode']}{', dynamic' if c['dynamic'] else ''})  "
                   f"on {_short_target(c['target'])}  [{', '.join(c['formats'])}]  {opts}")
        for u in v.get("uncovered") or []:
            yield (f"  NOT COVERED: {u['inputs']} ({u['grad_mode']}) on "
                   f"{_short_target(u['target'])}: asked {u['count']}x, rejected: "
                   f"{', '.join(u['codes'])}" + (f"; {u['hint']}" if u.get("hint") else ""))
        if v.get("not_served"):
            # Covered is not served: `farm misses` says why each was not.
            yield (f"  nodes reported {v['not_served']} request(s) not served "
                   f"(`farm misses {name}` says why)")


def cmd_coverage(args: argparse.Namespace) -> int:
    name, version = args.model
    return answer(args, _client(args).coverage(name, version),
                  lambda body: _coverage_lines(name, body))


def _policy_lines(p: dict[str, Any]) -> list[str]:
    interval = p.get("min_interval_s")
    lines = [f"{p['model']}: build on miss {'on' if p.get('build_on_miss') else 'off'}"
             + (f", at most one build per {interval:g} s" if interval else "")]
    if p.get("last_build_at"):
        lines.append(f"  last build on miss: {_when(p['last_build_at'])}")
    for b in p.get("miss_builds") or []:
        lines.append(f"  {_when(b['created_at'])}  {b['version']} {b['inputs']} "
                     f"({b['grad_mode']}) on {_short_target(b['target'])} -> job "
                     f"{str(b.get('job_id') or '?')[:8]}")
    return lines


def cmd_policy_show(args: argparse.Namespace) -> int:
    return answer(args, _client(args).policy(args.model), _policy_lines)


def cmd_policy_set(args: argparse.Namespace) -> int:
    if args.build_on_miss is None and args.min_interval is None:
        raise CommandFailed("nothing to set: pass --build-on-miss, --no-build-on-miss or "
                            "--min-interval S")
    p = _client(args).set_policy(args.model, build_on_miss=args.build_on_miss,
                                 min_interval_s=args.min_interval)
    return answer(args, p, _policy_lines)


def cmd_plan(args: argparse.Namespace) -> int:
    body = _client(args).plan(args.target, submit=args.submit, since_s=args.since)
    if args.json:
        _print_json(body)
        return EXIT_OK
    builds = body.get("builds") or []
    if not builds:
        print(f"nothing to build: every model and alias the fleet uses is covered on "
              f"{args.target}")
        return EXIT_OK
    print(f"{len(builds)} build(s) for {args.target}:")
    for b in builds:
        print(f"  {b['model']}@{b['version']} {';'.join(b['inputs'])} ({b['grad_mode']}) on "
              f"{_short_target(b['target'])}  <- {', '.join(b['why'])}")
    jobs = body.get("jobs")
    if jobs is not None:
        failed = [j for j in jobs if j.get("error")]
        for j in jobs:
            if j.get("error"):
                print(f"  not submitted: {j['model']}@{j['version']}: {j['error']}")
            else:
                print(f"  submitted {j['model']}@{j['version']} -> job {j['job_id']}")
        if failed:
            raise CommandFailed(f"{len(failed)} of {len(jobs)} plan job(s) were not submitted")
    else:
        print("(farm plan ... --submit submits them)")
    return EXIT_OK


def add_parsers(sub: Any, *, model_ref: Any) -> None:
    """The commands' parsers, on the CLI's subparsers."""
    command(sub, "misses", cmd_misses,
            "what fleet nodes did not get from the farm (their reports), most frequent first",
            arg("model", nargs="?", default=None, metavar="MODEL"),
            arg("--since", type=float, default=None, metavar="S", help="only the last S seconds"),
            arg("--limit", type=int, default=50, metavar="N",
                help="at most N groups (default: 50)"))
    command(sub, "coverage", cmd_coverage,
            "what each version's artifacts serve, and what nodes asked for that none does",
            arg("model", type=model_ref, metavar="MODEL[@VERSION]"))

    policy = group(sub, "policy", "a model's fleet policy (build on miss)", dest="policy_command")
    command(policy, "show", cmd_policy_show, "MODEL's policy and its recent builds on miss",
            arg("model", metavar="MODEL"))
    command(policy, "set", cmd_policy_set, "turn build on miss on or off for MODEL",
            arg("model", metavar="MODEL"),
            arg("--build-on-miss", dest="build_on_miss", action="store_true", default=None,
                help="a miss nodes report (a known version on a live target, or a shape no "
                     "artifact covers) starts a build"),
            arg("--no-build-on-miss", dest="build_on_miss", action="store_false",
                help="stop building what nodes miss"),
            arg("--min-interval", type=float, default=None, metavar="S",
                help="at most one build on miss per S seconds for this model (default 60)"))

    command(sub, "plan", cmd_plan,
            "the builds a target needs so every model and alias the fleet uses is covered there "
            "(e.g. a new torch)",
            arg("--target", required=True, metavar="SELECTOR",
                help="a full target, or a selector such as 'cpu/torch=2.14.0+cpu'"),
            arg("--submit", action="store_true", help="submit the builds"),
            arg("--since", type=float, default=None, metavar="S",
                help="count only node reports of the last S seconds"))
