#!/usr/bin/env bash
# The test command: installs what it needs (.venv with torch 2.13.0), starts
# PostgreSQL and Redis if they are not running, checks lint and types, runs
# every test (unit and integration, slow ones included) on three xdist workers.
# One worker runs a whole file (--dist loadfile: a file's tests share their
# module fixtures, a farm of their own; pytest 9 ignores the nodeid suffix that
# --dist loadgroup relies on), files in collection order (--no-loadscope-reorder),
# which tests/conftest.py sorts longest first.
# Three workers on two cores: much of a farm test is waiting (a heartbeat to
# go stale, a hanging model's time limit, a node's process start), and a third
# worker fills it; a fourth does not (beside stress --cpu 2 on 2 cores: -n 2
# 21:50, -n 3 19:00 and 18:33, -n 4 18:50; README, the suite's times).
# Arguments go to pytest after these, so `-n 0` or `-n 4` overrides the count.
# mypy runs beside pytest (it needs no services, and a fresh clone's first
# run takes half a minute); its verdict is read when pytest ends.
# Exit status: pytest's when it failed (1 failed, 2-5 errors), else mypy's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/services.sh
# The suite starts some 300 Python processes; with PYTHONDONTWRITEBYTECODE
# set (some shells and images set it) each compiled the farm's own modules
# again (1.4 CPU-s in a process that imports the API, workers, builder and
# node modules, on the CI machine), and every xdist
# worker rewrote every test module's asserts anew. The project's bytecode
# once, on every core, before they start:
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q -j 0 farm registry workers migrations tests bench >/dev/null
.venv/bin/ruff check farm registry workers migrations tests bench
.venv/bin/lint-imports
mypy_out=$(mktemp)
# mypy's incremental cache outside the clone, as uv's and pip's are: a fresh
# clone's first run checks everything (85 CPU-s on the CI machine, beside
# pytest's busiest minutes), later ones only what changed; mypy checks each
# cached file against its source's hash, so a stale entry is never used.
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torch-farm/mypy}
.venv/bin/mypy > "$mypy_out" 2>&1 &
mypy_pid=$!
rc=0
.venv/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=15 "$@" || rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_out"
rm -f "$mypy_out"
if [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
exit "$mypy_rc"
