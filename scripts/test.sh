#!/usr/bin/env bash
# The test command: installs what it needs (.venv with torch 2.13.0), starts
# PostgreSQL and Redis if they are not running, checks lint and types, runs
# every test (unit and integration, slow ones included) on two xdist workers.
# One worker runs a whole file (--dist loadfile: a file's tests share their
# module fixtures, a farm of their own; pytest 9 ignores the nodeid suffix that
# --dist loadgroup relies on), files in collection order (--no-loadscope-reorder),
# which tests/conftest.py sorts longest first.
# Arguments go to pytest after these, so `-n 0` or `-n 4` overrides the count.
# pytest's exit status is the script's (exec): 0 passed, 1 failed, 2-5 errors.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/services.sh
.venv/bin/ruff check farm registry workers migrations tests bench
.venv/bin/mypy
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 "$@"
