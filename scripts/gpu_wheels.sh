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
cryptography cffi pycparser opentelemetry-api prompt-toolkit wcwidth tzlocal tenacity cachetools
pyseccomp pytest pluggy iniconfig pytest-timeout psutil pygments packaging"
# `gpu_wheels.sh hf`: transformers and what it imports, into .whl-hf/ (the
# users'-model check builds a LlamaForCausalLM; carried only where needed).
if [ "${1:-}" = hf ]; then
  PKGS="transformers tokenizers safetensors huggingface-hub regex pyyaml tqdm typer httpx anyio
sniffio h11 httpcore certifi idna rich shellingham markdown-it-py mdurl pygments typing-extensions
filelock fsspec packaging httpx2 httpcore2 truststore hf-xet click annotated-doc"
fi
DEST=.whl
[ "${1:-}" = hf ] && DEST=.whl-hf
for d in /.whl/ /.whl-hf/ /.deb/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p "$DEST"
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
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d "$DEST" "${pin:-$p}"
done
ls "$DEST"
