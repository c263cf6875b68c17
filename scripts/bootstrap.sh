#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (the CPU wheel on this machine's disk) and the
# project installed editable: torch-farm (the node, the CLI, the builders) with
# the dev extras, and torch-farm-server (./server: the API, workers and
# migrations) with PostgreSQL's driver. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
# The system packages the farm and its tests need, from apt where missing:
# in the background, beside the virtual environment's set-up (on a fresh
# CI machine apt took 49 s before the venv was begun; the two share nothing).
system_packages() {
  # Build workers run model code under bubblewrap (farm.build.sandbox): a worker
  # that cannot isolate refuses to start, and the sandbox tests need it.
  # Their seccomp filter (farm.build.syscall_filter) is built with libseccomp.
  if ! command -v bwrap >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q libseccomp.so; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2 libseccomp-dev) \
        >/dev/null 2>&1 \
        || echo "bootstrap: could not install bubblewrap and libseccomp" \
                "(apt-get install -y bubblewrap libseccomp2)" >&2
    else
      echo "bootstrap: bubblewrap (bwrap) or libseccomp is missing: install them" \
           "(apt-get install -y bubblewrap libseccomp2)" >&2
    fi
  fi
  # The deployment's tests (tests/unit/test_compose.py, test_seccomp_profile.py):
  # a compose CLI that validates docker-compose.yml without a daemon (Debian's
  # docker-compose, unless the docker compose plugin is there) and libseccomp's
  # Python binding, which applies the workers' seccomp profile as runc does.
  need=()
  if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
    need+=(docker-compose)
  fi
  if ! /usr/bin/python3 -c "import seccomp" >/dev/null 2>&1; then
    need+=(python3-seccomp)
  fi
  if [ "${#need[@]}" -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") \
        >/dev/null 2>&1 \
        || echo "bootstrap: could not install ${need[*]} (apt-get install -y ${need[*]})" >&2
    else
      echo "bootstrap: missing ${need[*]}: install them (apt-get install -y ${need[*]})" >&2
    fi
  fi
  # The dashboard's browser test (tests/integration/test_dashboard.py) drives
  # Debian's chromium headless through playwright; playwright's own browser
  # download is never used.
  if [ ! -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
        >/dev/null 2>&1 \
        || echo "bootstrap: could not install chromium (apt-get install -y chromium)" >&2
    else
      echo "bootstrap: chromium is missing: install it (apt-get install -y chromium)" >&2
    fi
  fi
}
system_packages &
system_pid=$!
PY=${PYTHON:-python3}
# What it is doing, on stderr: a fresh clone's first run takes about a minute.
say() { echo "bootstrap: $* ($SECONDS s)" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.farm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ server/pyproject.toml -nt "$stamp" ]; then
  say "installing into .venv: pip and uv, then torch 2.13.0"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q --no-compile uv >/dev/null 2>&1 || true
  uv() { .venv/bin/python -m uv pip install --python .venv/bin/python -q --no-config "$@"; }
  # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA
  # build. The CPU wheel on this machine's disk (the folder pip's
  # configuration names; uv reads none) by its path, through uv, which links
  # it from its cache (3.3 s against pip's 11.3 s here); else pip, which finds
  # it. --no-compile, then compileall on every core: pip byte-compiles one
  # file at a time (torch: 16.6 s of which 11.6 s compiling, on 2 cores; the
  # whole venv in parallel: 4.1 s). Sandboxed build children see the venv
  # read-only and could not write the .pyc files themselves.
  links="${PIP_FIND_LINKS:-} $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)"
  wheel=$(for d in $links; do ls "$d"/torch-2.13.0+cpu-*.whl 2>/dev/null || true; done | head -n 1)
  if [ -z "$wheel" ] || ! uv "$wheel" 2>/dev/null; then
    .venv/bin/python -m pip install -q --no-compile "torch==2.13.0" 2>&1 | grep -v "is ignored: it is neither" || true
  fi
  # The rest (about 90 packages) through uv, which keeps the installed torch:
  # 8 s against pip's 40 s on a fresh clone here (this script's whole run:
  # 36.5 s against 64.6 s). pip installs them where uv cannot be had.
  say "installing torch-farm .[dev] and torch-farm-server ./server[postgres] and their dependencies (about 90 packages)"
  if ! uv -e ".[dev]" -e "./server[postgres]"; then
    echo "bootstrap: uv unavailable or failed; installing with pip" >&2
    .venv/bin/python -m pip install -q --no-compile -e ".[dev]" -e "./server[postgres]" 2>&1 | grep -v "is ignored: it is neither" || true
  fi
  # Not what is never imported: transformers' 560 model folders but llama's
  # (the farm's Hugging Face zoo), packages' own test folders, and mypy's
  # sources (it runs compiled). 71 s -> 53 s of this script on the CI machine
  # (2 cores), the larger part of a fresh clone's set-up.
  skip='/site-packages/(transformers/models/(?!(llama|auto)/)[^/]+/|(mypy|mypyc)/)|/tests?/'
  say "byte-compiling .venv (sandboxed builds read it read-only)"
  .venv/bin/python -m compileall -q -j 0 -x "$skip" .venv/lib >/dev/null 2>&1 || true
  .venv/bin/python -c "import torch, celery, sqlalchemy, fastapi, moto" 
  touch "$stamp"
  installed=1
fi
wait "$system_pid" || true
if [ -n "${installed:-}" ]; then
  say "done: activate it with 'source .venv/bin/activate'"
fi
