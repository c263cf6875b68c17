#!/usr/bin/env bash
# Issue 7's whole check in ONE device call (device time is scarce):
#   build on the H200 through an embedded farm (bench/gpu_farm.py), then the
#   cold-start benchmark against that farm (bench/coldstart.py --device cuda).
# Run from the device tool with `.whl` carried (the wheels the GPU image lacks:
# see README "CUDA targets"); results land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 FARM_HOME=/tmp/farm-gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())"
ONLY=${GPU_JOBS:-}
timeout "${FARM_BUDGET_S:-330}" python3 bench/gpu_farm.py --out "$OUT" --keep --timeout "${JOBS_TIMEOUT_S:-300}" ${ONLY:+--only $ONLY}
URL=$(cat /tmp/farm-gpu/url 2>/dev/null)
if [ -n "$URL" ] && [ "${SKIP_COLDSTART:-0}" != 1 ]; then
  timeout "${COLDSTART_BUDGET_S:-200}" python3 bench/coldstart.py --device cuda --model bench \
    --repeats "${REPEATS:-1}" --steady-calls 20 --farm-url "$URL" --out "$OUT" \
    --sequential-imports
fi
[ -f /tmp/farm-gpu/serve.pid ] && kill -TERM -- "-$(cat /tmp/farm-gpu/serve.pid)" 2>/dev/null
sleep 2
tar czf "$OUT/farm-logs.tgz" -C /tmp/farm-gpu logs serve.log 2>/dev/null
echo "gpu_check done"
