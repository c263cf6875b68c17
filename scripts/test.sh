#!/usr/bin/env bash
# The test command: installs what it needs (.venv with torch 2.13.0), starts
# PostgreSQL and Redis if they are not running, checks lint and types, runs
# every test (unit and integration, slow ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/services.sh
.venv/bin/ruff check farm registry workers migrations tests bench
.venv/bin/mypy
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
