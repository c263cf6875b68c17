# Sourced by the GPU scripts (gpu_users.sh, gpu_sandbox.sh): what the lent
# GPU host lacks, carried with the device call and set up without an install
# step, and a cgroup v2 subtree for the builds where the host can give one.
# Expects `stamp` (a timestamped echo) to be defined by the caller, or
# gpu_script_start to be called first.

# A GPU script's start: results go to $OUT (else bench/results), and
# `stamp` prints a line with the seconds since this call.
gpu_script_start() {
  OUT=${OUT:-bench/results}
  mkdir -p "$OUT"
  t0=$SECONDS
  stamp() { echo "[$((SECONDS - t0)) s] $*"; }
}

# bubblewrap and libseccomp from Debian's packages in .deb/, unpacked into a
# folder of their own and put on PATH / LD_LIBRARY_PATH (the GPU image has
# neither; farm.build.syscall_filter finds the library there).
use_carried_debs() {
  local root=/tmp/debroot f
  # Once per machine: a second script of the same run (gpu_check.sh starts
  # gpu_users.sh beside its own farm) must not pull bwrap from under it.
  if [ ! -f "$root/.farm-carried" ]; then
    rm -rf "$root" && mkdir -p "$root"
    for f in .deb/*.deb; do [ -f "$f" ] && dpkg-deb -x "$f" "$root"; done
    touch "$root/.farm-carried"
  fi
  export PATH=$root/usr/bin:$PATH
  export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  stamp "uid $(id -u); bwrap: $(command -v bwrap) $(bwrap --version 2>&1); kernel $(uname -r)"
}

# The wheels in each named folder into /tmp/site (once per machine), and
# /tmp/site on PYTHONPATH, as the farm's dependencies are on the H200 image:
# what the isolated children must still import (farm.build.isolation binds
# the worker's PYTHONPATH read-only).
install_carried_wheels() {
  local d
  if [ ! -f /tmp/site/.farm-carried-installed ]; then
    for d in "$@"; do
      ls "$d"/*.whl >/dev/null 2>&1 || continue
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$d"/*.whl || return 1
    done
    touch /tmp/site/.farm-carried-installed
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

# A cgroup v2 directory for builds (memory.max / pids.max per build), when
# the host's cgroup2 can hand those controllers down; its path in
# $BUILD_CGROUP, empty when none.
delegate_build_cgroup() {
  local cg=/sys/fs/cgroup p
  BUILD_CGROUP=
  stamp "cgroup fs: $(stat -fc %T $cg); controllers: $(cat $cg/cgroup.controllers 2>/dev/null)"
  [ "$(stat -fc %T $cg)" = cgroup2fs ] || return 0
  if ! echo "+memory +pids" >$cg/cgroup.subtree_control 2>/dev/null; then
    # A namespace root with processes in it cannot hand controllers down:
    # move them into a leaf first (as container init scripts do).
    mkdir -p $cg/init
    for p in $(cat $cg/cgroup.procs); do echo "$p" >$cg/init/cgroup.procs 2>/dev/null; done
    echo "+memory +pids" >$cg/cgroup.subtree_control 2>/dev/null || true
  fi
  mkdir -p $cg/farm-builds 2>/dev/null \
    && echo "+memory +pids" >$cg/farm-builds/cgroup.subtree_control 2>/dev/null \
    && BUILD_CGROUP=$cg/farm-builds
  stamp "build cgroup: ${BUILD_CGROUP:-none} ($(cat $cg/farm-builds/cgroup.subtree_control 2>/dev/null))"
}
