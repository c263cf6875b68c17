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

DEB=/tmp/debroot
rm -rf "$DEB" && mkdir -p "$DEB"
for f in .deb/*.deb; do [ -f "$f" ] && dpkg-deb -x "$f" "$DEB"; done
export PATH=$DEB/usr/bin:$PATH
export LD_LIBRARY_PATH=$DEB/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
stamp "uid $(id -u); bwrap: $(command -v bwrap) $(bwrap --version 2>&1); kernel $(uname -r)"
if [ ! -f /tmp/site/.gpu_sandbox-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.gpu_sandbox-installed
fi
# The farm's dependencies from PYTHONPATH, as on the H200 image: what the
# isolated children must still import (farm.build.isolation binds them).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version())"
# pyseccomp finds libseccomp through ldconfig; the carried one is not in its cache.
python3 - <<'PY'
import ctypes.util, os
print("libseccomp:", ctypes.util.find_library("seccomp"))
PY

# A cgroup for builds, when the host's cgroup2 can give one.
CG=/sys/fs/cgroup
stamp "cgroup fs: $(stat -fc %T $CG); controllers: $(cat $CG/cgroup.controllers 2>/dev/null); subtree: $(cat $CG/cgroup.subtree_control 2>/dev/null)"
cg_ok=0
if [ "$(stat -fc %T $CG)" = cgroup2fs ]; then
  if ! echo "+memory +pids" > $CG/cgroup.subtree_control 2>/dev/null; then
    # A namespace root with processes in it cannot hand controllers down:
    # move them into a leaf first (as container init scripts do).
    mkdir -p $CG/init
    for p in $(cat $CG/cgroup.procs); do echo "$p" > $CG/init/cgroup.procs 2>/dev/null; done
    echo "+memory +pids" > $CG/cgroup.subtree_control || true
  fi
  mkdir -p $CG/farm-builds && echo "+memory +pids" > $CG/farm-builds/cgroup.subtree_control \
    && cg_ok=1
fi
stamp "build cgroup usable: $cg_ok ($(cat $CG/farm-builds/cgroup.subtree_control 2>/dev/null))"
[ "$cg_ok" = 1 ] && export FARM_TEST_BUILD_CGROUP=$CG/farm-builds

export FARM_HOME=/tmp/farm-sandbox-home
stamp "sandbox tests"
timeout 540 python3 -m pytest -p no:cacheprovider -q -x --timeout 500 \
  tests/unit/test_sandbox_attacks.py tests/unit/test_sandbox_isolation.py \
  tests/unit/test_cgroup_limits.py tests/unit/test_sandbox_fork_bomb.py \
  tests/unit/test_uid_slots.py tests/unit/test_build_memory.py 2>&1 | tail -40
stamp "done"
