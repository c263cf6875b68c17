#!/usr/bin/env bash
# What a build costs on a GPU host, and where a node's load of a training
# artifact goes, in one device call of under 10 minutes:
# bench/cuda_train_load.py (a training artifact loaded by fresh processes,
# step by step, with Triton's cache empty, warm or the build's),
# bench/compile_time.py (a 16-layer Llama, full graph against regional,
# inference and training) and bench/build_cost.py (a cold build against the
# rebuilds the shared compile cache serves: identical layers, distinct
# layers, regional) and bench/isa_checks.py (Inductor's ISA pick with and
# without the worker's recorded test compiles), one after another so that
# no two time each other.
# Each step has its own time limit and writes its table as it ends, so a
# call cut short still brings back what finished.
#
# Prepare here: scripts/gpu_wheels.sh, scripts/gpu_wheels.sh hf and the .deb/
# packages (scripts/gpu_check.sh says how); run with the device tool carrying
# .whl, .whl-hf and .deb:
#   OUT=$OUT bash scripts/gpu_build_time.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_carried.sh
gpu_script_start
use_carried_debs
command -v bwrap >/dev/null || stamp "WARNING: no bwrap here: builds run unisolated, in fresh children (no zygote), unlike a worker's; carry .deb (scripts/gpu_check.sh says how)"
install_carried_wheels .whl .whl-hf || exit 1
# The compiler the GPU image's worker chooses (farm.build.toolchain picks
# /usr/bin/g++ there; its full choice costs about a minute and these
# aot_compile builds link no C++ wrapper).
export CXX=${CXX:-/usr/bin/g++}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${TRAIN_LOAD_S:-150}" != 0 ]; then   # TRAIN_LOAD_S=0: not this time
  stamp "cuda_train_load"
  timeout "${TRAIN_LOAD_S:-150}" python3 bench/cuda_train_load.py --repeats "${TRAIN_LOAD_REPEATS:-2}" \
    --profile "$OUT/cuda_train_load-profile.txt" --out "$OUT/cuda_train_load.txt" \
    >"$OUT/cuda_train_load.log" 2>&1
  stamp "cuda_train_load rc=$?"
fi
# STEADY_S: bench/per_block_steady.py (per-block against the full graph per
# call, interleaved in one process) for each of STEADY_KINDS, each limited
# to STEADY_S seconds; off unless set. STEADY_ARGS: more options, e.g.
# "--launches 20 --dim 512".
for k in ${STEADY_KINDS:-inference training}; do
  [ "${STEADY_S:-0}" != 0 ] || break
  stamp "per_block_steady $k"
  # shellcheck disable=SC2086
  timeout "$STEADY_S" python3 bench/per_block_steady.py --device cuda --kind "$k" \
    --rounds "${STEADY_ROUNDS:-7}" --calls "${STEADY_CALLS:-100}" ${STEADY_ARGS:-} \
    --out "$OUT/per_block_steady-cuda-$k.txt" >"$OUT/per_block_steady-cuda-$k.log" 2>&1
  stamp "per_block_steady $k rc=$?"
done
if [ "${COMPILE_TIME_S:-190}" != 0 ]; then   # COMPILE_TIME_S=0: not this time
  stamp "compile_time"
  # COMPILE_TIME_ARGS: more options, e.g. "--kinds inference --modes regional,per_block".
  # shellcheck disable=SC2086
  timeout "${COMPILE_TIME_S:-190}" python3 bench/compile_time.py --device cuda \
    ${COMPILE_TIME_ARGS:-} --out "$OUT/compile_time-cuda.txt" >"$OUT/compile_time-cuda.log" 2>&1
  stamp "compile_time rc=$?"
fi
run_cost() {   # NAME LIMIT_S [build_cost.py options]
  local name=$1 limit=$2; shift 2
  stamp "build_cost $name"
  timeout "$limit" python3 bench/build_cost.py --device cuda "$@" \
    --out "$OUT/build_cost-cuda-$name.txt" >"$OUT/build_cost-cuda-$name.log" 2>&1
  stamp "build_cost $name rc=$?"
}
# BUILD_COST picks the cases (full distinct regional per-block aoti; the
# default's three fit 600 s only without the steps above), BUILD_COST= none.
for c in ${BUILD_COST-full distinct regional}; do
  case $c in
    full) run_cost full "${FULL_S:-110}";;
    distinct) run_cost distinct "${DISTINCT_S:-100}" --distinct;;
    regional) run_cost regional "${REGIONAL_S:-100}" --option regional=true;;
    per-block) run_cost per-block "${PER_BLOCK_S:-100}" --distinct --option per_block=true;;
    aoti) run_cost aoti "${AOTI_S:-200}" --aoti;;   # the AOTI package too, and its cache
  esac
done
if [ "${ISA_CHECKS_S:-150}" != 0 ]; then   # ISA_CHECKS_S=0: not this time
  stamp "isa_checks"
  timeout "${ISA_CHECKS_S:-150}" python3 bench/isa_checks.py --rounds "${ISA_CHECKS_ROUNDS:-1}" \
    --out "$OUT/isa_checks.txt" >"$OUT/isa_checks.log" 2>&1
  stamp "isa_checks rc=$?"
fi
for f in "$OUT"/per_block_steady-cuda-*.txt "$OUT"/isa_checks.txt "$OUT"/cuda_train_load.txt "$OUT"/compile_time-cuda.txt "$OUT"/build_cost-cuda-*.txt; do
  [ -f "$f" ] || continue   # a step that did not run (else the script ends 1)
  echo "== $f"; cat "$f"
done
