#!/usr/bin/env bash
# Issue 15's check in ONE device call (device time is scarce), with no variable
# set by hand:
#   1. the compile worker's C++ compiler for CUDA (farm.build.toolchain: each
#      candidate builds, links the shared libstdc++ and loads a tiny AOTI package);
#   2. builds on the H200 through an embedded farm (bench/gpu_farm.py), each
#      artifact verified in a fresh process;
#   3. the cold-start benchmark against that farm (bench/coldstart.py --device
#      cuda), median of 3 rounds, inference and training fleet paths.
# Everything fits GPU_CHECK_BUDGET_S (default 570 s: the device tool stops a
# command at 600 s); the cold start gets what the builds leave and stops before
# a round that would not fit. The farm is stopped on every way out.
# Run from the device tool with `.whl` carried (scripts/gpu_wheels.sh fetches
# the wheels the GPU image lacks); results land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
BUDGET=${GPU_CHECK_BUDGET_S:-570}
COLDSTART_MIN_S=${COLDSTART_MIN_S:-230}   # three rounds of the rows below (~60 s each on the H200)
JOBS=${GPU_JOBS:-bench-default bench-autotune bench-train}
HOME_DIR=/tmp/farm-gpu
left() { echo $((BUDGET - SECONDS)); }

stop_farm() {
  local pid
  pid=$(cat "$HOME_DIR/serve.pid" 2>/dev/null) || return 0
  [ -n "$pid" ] || return 0
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$HOME_DIR/serve.pid"
  echo "farm stopped (pid $pid)"
}
finish() {
  stop_farm
  tar czf "$OUT/farm-logs.tgz" -C "$HOME_DIR" logs serve.log 2>/dev/null
  echo "gpu_check done after ${SECONDS} s"
}
trap finish EXIT
# A url or pid file from an earlier run must not be taken for this one's.
rm -rf "$HOME_DIR"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 FARM_HOME=$HOME_DIR
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())"
echo "CXX=${CXX:-} g++ on PATH: $(command -v g++) ($(g++ --version 2>/dev/null | head -1))"

# 1. The compiler choice, cached per machine: the worker started below reads it.
echo "== compiler choice (budget left $(left) s)"
timeout $(( $(left) - COLDSTART_MIN_S - 60 )) python3 -m farm.build.toolchain cuda
echo "toolchain rc=$?"

# 2. Builds.
FARM_S=$(( $(left) - COLDSTART_MIN_S ))
echo "== builds: $JOBS (budget ${FARM_S} s)"
# shellcheck disable=SC2086
timeout "$FARM_S" python3 bench/gpu_farm.py --out "$OUT" --home "$HOME_DIR" --keep \
  --timeout $((FARM_S - 40)) --only $JOBS
farm_rc=$?
echo "gpu_farm rc=$farm_rc"

# 3. Cold start, if the farm is up and its builds ended.
URL=$(cat "$HOME_DIR/url" 2>/dev/null)
if [ "$farm_rc" -ne 0 ]; then
  echo "cold start skipped: the builds did not finish (rc $farm_rc)"
elif [ -z "$URL" ] || ! python3 -c "import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + '/healthz', timeout=5)" "$URL" 2>/dev/null; then
  echo "cold start skipped: no farm answering at ${URL:-(no url file)}"
else
  CS_S=$(( $(left) - 15 ))
  echo "== cold start against $URL (budget ${CS_S} s)"
  timeout "$CS_S" python3 bench/coldstart.py --device cuda --model bench --repeats 3 \
    --steady-calls 20 --farm-url "$URL" --out "$OUT" \
    --farm-models bench-default bench-autotune \
    --farm-train-models bench-train --skip megacache jit-autotune \
    --budget-s $((CS_S - 10))
  echo "coldstart rc=$?"
fi
