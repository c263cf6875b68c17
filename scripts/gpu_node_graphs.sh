#!/usr/bin/env bash
# A node's calls replayed from CUDA graphs, on a GPU host, in one device call
# of about 6 minutes: the tests of farm.node.cuda_graphs that need a GPU
# (tests/unit/test_cuda_graphs.py: replays against the call they replay,
# weights changed in place or replaced, a forward that cannot be recorded, a
# real full-graph and per-block artifact), then bench/per_block_steady.py
# with --cuda-graphs: per-block and the full graph per call, each as it is
# and replayed, side by side in one process (STEADY_ARGS adds options, e.g.
# "--launches 20").
#
# Prepare here: scripts/gpu_wheels.sh (it carries pytest); run with the
# device tool carrying .whl:
#   OUT=$OUT bash scripts/gpu_node_graphs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_carried.sh
gpu_script_start
install_carried_wheels .whl || exit 1
export CXX=${CXX:-/usr/bin/g++}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
if [ "${TESTS_S:-200}" != 0 ]; then   # TESTS_S=0: not this time
  stamp "tests"
  # --noconftest: the suite's conftest loads the database fixtures, whose
  # driver the GPU image lacks; this file needs none of it.
  timeout "${TESTS_S:-200}" python3 -m pytest --noconftest -p no:cacheprovider -p no:logging \
    -q -rs --tb=short tests/unit/test_cuda_graphs.py >"$OUT/gpu_node_graphs-tests.log" 2>&1
  rc=$?
  stamp "tests rc=$rc"; tail -n 25 "$OUT/gpu_node_graphs-tests.log"
fi
# STEADY_SHAPES: BATCH,SEQ:WIDTH of each bench run (default one launch-bound
# call; "1,64:128 8,512:1024" adds one whose GPU work dominates);
# STEADY_KINDS: inference, training or both.
for kind in ${STEADY_KINDS:-inference}; do
  for shape in ${STEADY_SHAPES:-1,64:128}; do
    [ "${STEADY_S:-240}" != 0 ] || break
    tokens=${shape%%:*} dim=${shape##*:}
    name="per_block_steady-cuda-graphs-$kind-${tokens/,/x}-dim$dim"
    stamp "per_block_steady --kind $kind --cuda-graphs --tokens $tokens --dim $dim"
    # shellcheck disable=SC2086
    timeout "${STEADY_S:-240}" python3 bench/per_block_steady.py --device cuda --kind "$kind" \
      --cuda-graphs --tokens "$tokens" --dim "$dim" --rounds "${STEADY_ROUNDS:-7}" \
      --calls "${STEADY_CALLS:-100}" ${STEADY_ARGS:-} --out "$OUT/$name.txt" >"$OUT/$name.log" 2>&1
    stamp "per_block_steady rc=$?"
    cat "$OUT/$name.txt" 2>/dev/null || tail -n 30 "$OUT/$name.log"
  done
done
exit $rc
