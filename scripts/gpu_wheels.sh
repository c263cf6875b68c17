#!/usr/bin/env bash
# Fetch into .whl/ the wheels the lent H200 lacks (it has no network): the
# farm's own dependencies for CPython 3.12 on x86-64, pinned to the versions
# of this checkout's .venv when there is one (else of $PYTHON, else the
# newest). scripts/gpu_check.sh installs them there. .whl/ is kept out of git
# (.git/info/exclude) and carried by the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="celery kombu billiard vine amqp click-didyoumean click-plugins click-repl redis
sqlalchemy greenlet alembic mako fastapi starlette pydantic pydantic-core pydantic-settings
annotated-types typing-inspection python-dotenv uvicorn boto3 botocore s3transfer jmespath
cryptography cffi pycparser opentelemetry-api prompt-toolkit wcwidth tzlocal tenacity cachetools"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
freeze=""
for py in .venv/bin/python "${PYTHON:-}"; do
  if [ -n "$py" ] && [ -x "$(command -v "$py" 2>/dev/null)" ]; then
    freeze=$("$py" -m pip freeze 2>/dev/null | tr 'A-Z_' 'a-z-') && [ -n "$freeze" ] && break
  fi
done
[ -n "$freeze" ] || echo "gpu_wheels: no .venv or \$PYTHON to pin from: fetching the newest versions" >&2
for p in $PKGS; do
  pin=$(grep -E "^${p}==" <<<"$freeze" || true)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .whl "${pin:-$p}"
done
ls .whl
