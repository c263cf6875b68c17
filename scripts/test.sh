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
.venv/bin/ruff check farm registry workers migrations tests bench
.venv/bin/lint-imports
mypy_out=$(mktemp)
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
