#!/usr/bin/env bash
# The GPU host's whole check, unattended, with nothing set by hand:
#   1. the sandbox's tools carried (bubblewrap, libseccomp from .deb/, the
#      farm's wheels from .whl/: scripts/gpu_carried.sh), a cgroup for builds
#      where the host hands one down; the compile worker's C++ compiler
#      (farm.build.toolchain), chosen once per machine;
#   2. side by side: users' own models and the hostile-model suite on an
#      isolated CUDA worker (scripts/gpu_users.sh: an MLP, a bf16 Llama with
#      keyword inputs, a training step, each loaded by a fresh node process;
#      hostile models against the worker), and the benchmark builds on the
#      farm's defaults (bench/gpu_farm.py), each verified in a fresh process;
#   3. alone on the machine once both ended: the fleet cold start against the
#      benchmark farm (bench/coldstart.py --device cuda), median of 3 rounds,
#      inference and training, with an empty and a prefetched node cache;
#   4. with GPU_CHECK_EXTRAS=1 and budget left: the big-model build
#      (bench/big_model_build.py) and the shared-compile-cache benchmark
#      (bench/build_cost.py --device cuda);
#   5. one results file, $OUT/gpu_check-results.md: the builds, the users'
#      round trips, the hostile table and the cold-start table.
#
#   scripts/gpu_check.sh             all of it in one run (about 18 minutes)
#   scripts/gpu_check.sh start       `all` detached (its own session), then return
#   scripts/gpu_check.sh wait [S]    wait up to S s (570) for it; copy its results to $OUT
#   scripts/gpu_check.sh build       1 and the builds, and leave the farm running
#   scripts/gpu_check.sh coldstart   3 against the farm `build` left, then stop it
#
# A whole run is longer than the device tool's 600 s a command, so it runs
# detached across two calls: `start; wait` in the first, `wait` in the second
# (the machine stays up for 30 s between them; the run is one process
# session). Every step writes its files as it ends, so a run cut short still
# leaves what it measured. The farm is stopped on every way out except the
# end of a successful `build`.
# Run from the device tool carrying .whl and .deb (scripts/gpu_wheels.sh and
#   mkdir -p .deb && (cd .deb && apt-get download bubblewrap libseccomp2 libcap2));
# results land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
DETACHED=/tmp/gpu_check-detached   # where a detached `all` writes, across calls
case "$PHASE" in
  all|build|coldstart) ;;
  start)
    # The run works from its own copy of the tree: the device tool re-sends
    # (replaces) the carried tree at every call, and the `wait` call would
    # delete the files under a run started in it (seen: build_cost.py missing
    # 800 s into the run, 2026-12-01).
    rm -rf "$DETACHED" && mkdir -p "$DETACHED/tree"
    cp -a . "$DETACHED/tree/"
    OUT="$DETACHED" setsid nohup bash "$DETACHED/tree/scripts/gpu_check.sh" all \
      >"$DETACHED/nohup.out" 2>&1 </dev/null &
    echo $! >"$DETACHED/pid"
    echo "gpu_check all started detached (pid $!), writing to $DETACHED"
    exit 0;;
  wait)
    pid=$(cat "$DETACHED/pid" 2>/dev/null) || { echo "no detached run (start one)"; exit 2; }
    end=$((SECONDS + ${2:-570}))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    if [ -n "${OUT:-}" ]; then
      # The device tool brings back 8 files: the summary and logs first.
      (cd "$DETACHED" && tar czf "$OUT/gpu_check-files.tgz" --exclude=tree --exclude=nohup.out . 2>/dev/null)
      cp "$DETACHED"/gpu_check-results.md "$DETACHED"/gpu_check-all.log "$DETACHED"/gpu_users.log \
        "$OUT"/ 2>/dev/null
    fi
    tail -n 40 "$DETACHED/gpu_check-all.log" 2>/dev/null
    if kill -0 "$pid" 2>/dev/null; then echo "still running (pid $pid): wait again"; exit 75; fi
    exit 0;;
  *) echo "usage: $0 [all|start|wait [S]|build|coldstart]"; exit 2;;
esac
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check-$PHASE.log") 2>&1
# One phase's budget; `all` gets both.
BUDGET=${GPU_CHECK_BUDGET_S:-$([ "$PHASE" = all ] && echo 1080 || echo 570)}
EXTRAS_S=0   # build_cost's share, with GPU_CHECK_EXTRAS=1
[ "$PHASE" = all ] && [ "${GPU_CHECK_EXTRAS:-0}" = 1 ] && EXTRAS_S=${GPU_CHECK_EXTRAS_S:-330}
COLDSTART_MIN_S=${COLDSTART_MIN_S:-$([ "$PHASE" = build ] && echo 0 || echo 240)}   # 3 rounds, ~70 s each
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
KEEP_FARM=0
# One file with every table this run produced (what is missing says so).
write_results() {
  local r=$OUT/gpu_check-results.md f
  {
    echo "# scripts/gpu_check.sh $PHASE, $(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS} s"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())" 2>&1
    echo "bwrap: $(command -v bwrap || echo none); build cgroup: ${FARM_BUILD_CGROUP:-none}"
    echo '```'
    echo
    echo "## Builds on the farm's defaults (bench/gpu_farm.py)"
    echo '```'
    for f in "$OUT"/gpu_farm-*.txt; do [ -f "$f" ] && cat "$f"; done
    echo '```'
    echo
    echo "## Users' own models (scripts/gpu_users.sh)"
    echo '```'
    grep -E "^\[[0-9]+ s\] (starting|farm ready|submit|mlp|llama|train|node|the planted|HOSTILE|a build after)" \
      "$OUT/gpu_users.log" 2>/dev/null || echo "(no users' run log)"
    grep -hE "^node (mlp|llama|train):" "$OUT/gpu_users.log" 2>/dev/null
    echo '```'
    echo
    echo "## Hostile models on the CUDA worker"
    cat "$OUT/gpu_users-hostile.txt" 2>/dev/null || echo "(not run)"
    echo
    echo "## Fleet cold start (bench/coldstart.py --device cuda)"
    echo '```'
    for f in "$OUT"/coldstart-cuda-*.txt; do [ -f "$f" ] && cat "$f"; done
    echo '```'
  } >"$r" 2>&1
}
finish() {
  [ "$KEEP_FARM" = 1 ] || stop_farm
  tar czf "$OUT/farm-logs.tgz" -C "$HOME_DIR" logs serve.log 2>/dev/null
  [ "$PHASE" = build ] || write_results
  echo "gpu_check done after ${SECONDS} s"
}
trap finish EXIT
# A url or pid file from an earlier run must not be taken for this one's.
[ "$PHASE" = coldstart ] || rm -rf "$HOME_DIR"

# The sandbox's tools and the farm's wheels, installed once per machine:
# `coldstart` must not rewrite the packages under the farm `build` left running.
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
. scripts/gpu_carried.sh
use_carried_debs
install_carried_wheels .whl || exit 1
if [ "$PHASE" != coldstart ]; then
  delegate_build_cgroup
  [ -z "${FARM_BUILD_CGROUP:-}" ] && [ -n "$BUILD_CGROUP" ] && export FARM_BUILD_CGROUP=$BUILD_CGROUP
fi
export FARM_HOME=$HOME_DIR
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())"
echo "CXX=${CXX:-} g++ on PATH: $(command -v g++) ($(g++ --version 2>/dev/null | head -1))"

if [ "$PHASE" != coldstart ]; then
  # 1. The compiler choice, cached per machine: the worker started below reads it.
  echo "== compiler choice (budget left $(left) s)"
  timeout $(( $(left) - COLDSTART_MIN_S - 120 )) python3 -m farm.build.toolchain cuda
  echo "toolchain rc=$? (${SECONDS} s into the run)"

  # 2. Builds, and in `all` the users' models and hostile suite beside them
  # (their own farm and worker; the cold start waits for both).
  if [ "$PHASE" = all ]; then
    echo "== users' models and hostile models (scripts/gpu_users.sh), beside the builds"
    OUT="$OUT" GPU_USERS_BUDGET_S=$(( $(left) - COLDSTART_MIN_S - 30 )) \
      bash scripts/gpu_users.sh run >"$OUT/gpu_users-run.out" 2>&1 &
    USERS_PID=$!
  fi
  if [ "$PHASE" = all ] && [ "${GPU_CHECK_EXTRAS:-0}" = 1 ]; then
    echo "== big-model build, beside the builds (its own 400 s limit)"
    timeout 400 python3 bench/big_model_build.py --out "$OUT/big_model_build-cuda.txt" \
      >"$OUT/big_model_build.log" 2>&1 &
    BIG_PID=$!
  fi
  FARM_S=$(( $(left) - COLDSTART_MIN_S - EXTRAS_S - 10 ))
  echo "== builds: $JOBS (budget ${FARM_S} s)"
  # shellcheck disable=SC2086
  timeout "$FARM_S" python3 bench/gpu_farm.py --out "$OUT" --home "$HOME_DIR" --keep \
    --timeout $((FARM_S - 30)) --only $JOBS
  farm_rc=$?
  echo "gpu_farm rc=$farm_rc"
  if [ -n "${USERS_PID:-}" ]; then
    stamp "builds done; waiting for the users' run (at most $(( $(left) - COLDSTART_MIN_S )) s)"
    end=$(( SECONDS + $(left) - COLDSTART_MIN_S ))
    while kill -0 "$USERS_PID" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 3; done
    if kill -0 "$USERS_PID" 2>/dev/null; then
      stamp "users' run still going: stopped for the cold start"
      pkill -TERM -P "$USERS_PID" 2>/dev/null; kill -TERM "$USERS_PID" 2>/dev/null; sleep 3
    fi
    wait "$USERS_PID" 2>/dev/null; stamp "users' run rc=$?"
  fi
  if [ "$farm_rc" -ne 0 ]; then
    echo "cold start skipped: the builds did not all finish (rc $farm_rc)"
    exit 1
  fi
  if [ "$PHASE" = build ]; then
    KEEP_FARM=1
    echo "farm left running at $(cat "$HOME_DIR/url") for: $0 coldstart"
    exit 0
  fi
fi

# 3. Cold start, if the farm is up and its builds ended; alone on the machine.
if [ -n "${BIG_PID:-}" ]; then wait "$BIG_PID"; echo "big_model_build rc=$?"; fi
URL=$(cat "$HOME_DIR/url" 2>/dev/null)
if [ -z "$URL" ] || ! python3 -c "import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + '/healthz', timeout=5)" "$URL" 2>/dev/null; then
  echo "cold start skipped: no farm answering at ${URL:-(no url file)}"
  exit 1
fi
CS_S=$(( $(left) - EXTRAS_S - 15 ))
# The cold start's fleet rows: the jobs built (GPU_JOBS trims both).
INFER=() TRAIN=()
for j in $JOBS; do
  case "$j" in bench-default|bench-autotune) INFER+=("$j");; bench-train) TRAIN+=("$j");; esac
done
echo "== cold start against $URL (budget ${CS_S} s)"
timeout "$CS_S" python3 bench/coldstart.py --device cuda --model bench --repeats 3 \
  --steady-calls 20 --farm-url "$URL" --out "$OUT" \
  --farm-models "${INFER[@]}" \
  ${TRAIN[@]:+--farm-train-models "${TRAIN[@]}" --agent} --skip megacache jit-autotune \
  --budget-s $((CS_S - 10))
echo "coldstart rc=$?"

if [ "$PHASE" = all ] && [ "${GPU_CHECK_EXTRAS:-0}" = 1 ]; then
  stop_farm   # build_cost times builds: nothing else on the machine
  echo "== build_cost (budget $(( $(left) - 10 )) s)"
  timeout $(( $(left) - 10 )) python3 bench/build_cost.py --device cuda \
    --out "$OUT/build_cost-cuda.txt"
  echo "build_cost rc=$?"
fi
