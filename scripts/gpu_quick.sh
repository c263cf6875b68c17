#!/usr/bin/env bash
# One device call of about 8 minutes, for a session with little device time
# left: the benchmark builds (GPU_JOBS, default bench-default bench-train)
# with the hostile suite's farm beside them (scripts/gpu_users.sh without the
# users' models; GPU_USERS_HOSTILE picks the models), then the fleet cold
# start alone. Results and logs land in $OUT (else bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export OUT GPU_JOBS=${GPU_JOBS:-bench-default bench-train}
GPU_CHECK_BUDGET_S=${BUILD_S:-260} timeout $(( ${BUILD_S:-260} + 10 )) \
  bash scripts/gpu_check.sh build >"$OUT/gpu_quick-build.log" 2>&1 &
BUILD=$!
sleep 25   # the carried packages, installed by the build phase first
GPU_USERS_MODELS=0 GPU_USERS_BUDGET_S=${USERS_S:-240} timeout $(( ${USERS_S:-240} + 10 )) \
  bash scripts/gpu_users.sh run >"$OUT/gpu_quick-users.out" 2>&1 &
USERS=$!
wait $BUILD; echo "build phase rc=$?"
grep -E "^bench-|rc=|farm left" "$OUT/gpu_quick-build.log" | cut -c1-300
wait $USERS; echo "hostile suite rc=$?"
cat "$OUT/gpu_users-hostile.txt" 2>/dev/null | cut -c1-400
GPU_CHECK_BUDGET_S=${COLD_S:-220} timeout $(( ${COLD_S:-220} + 5 )) \
  bash scripts/gpu_check.sh coldstart >"$OUT/gpu_quick-cold.log" 2>&1
echo "cold start rc=$?"
tail -n 30 "$OUT/gpu_quick-cold.log" | cut -c1-300
