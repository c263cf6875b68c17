#!/usr/bin/env bash
# The build sandbox's own tests on a GPU host as shipped (no bubblewrap, no
# network, the farm's dependencies on PYTHONPATH): one device call of a few
# minutes. bubblewrap and libseccomp come from Debian's packages in .deb/
# (unpacked, no install step), the farm's wheels and pytest from .whl/
# (scripts/gpu_wheels.sh, plus pytest, pluggy, iniconfig, packaging, pygments,
# pytest-timeout, psutil). Where the host's cgroup2 hands memory and pids
# down, a directory for builds is made (FARM_BUILD_CGROUP) and the
# kernel-limit test runs against it.
#
#   bash scripts/gpu_sandbox.sh      (results: $OUT/gpu_sandbox.log)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_sandbox.log") 2>&1
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

. scripts/gpu_carried.sh
use_carried_debs
install_carried_wheels .whl || exit 1
python3 -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version())"
# pyseccomp finds libseccomp through ldconfig; the carried one is not in its cache.
python3 - <<'PY'
import ctypes.util, os
print("libseccomp:", ctypes.util.find_library("seccomp"))
PY

delegate_build_cgroup
[ -n "$BUILD_CGROUP" ] && export FARM_TEST_BUILD_CGROUP=$BUILD_CGROUP

export FARM_HOME=/tmp/farm-sandbox-home
stamp "sandbox tests"
timeout 540 python3 -m pytest -p no:cacheprovider -q -x --timeout 500 \
  tests/unit/test_sandbox_attacks.py tests/unit/test_sandbox_isolation.py \
  tests/unit/test_cgroup_limits.py tests/unit/test_sandbox_fork_bomb.py \
  tests/unit/test_uid_slots.py tests/unit/test_build_memory.py 2>&1 | tail -40
stamp "done"
