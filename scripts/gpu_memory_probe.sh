#!/usr/bin/env bash
# What the GPU machine's memory does under a build's memory hog: MemTotal at
# start and as memory is taken, and whether a cgroup v2 memory.max stops a
# hog inside it (the farm's kernel limit) without harm to the machine.
#   bash scripts/gpu_memory_probe.sh [LIMIT_GB ...]     (default: 4 16)
set -u
mem() { awk '/MemTotal|MemAvailable/ {printf "%s %d MB  ", $1, $2/1024} END {print ""}' /proc/meminfo; }
echo "cores $(nproc); $(mem)"
cg=/sys/fs/cgroup
echo "cgroup fs $(stat -fc %T $cg); controllers: $(cat $cg/cgroup.controllers)"
if ! echo "+memory +pids" >$cg/cgroup.subtree_control 2>/dev/null; then
  mkdir -p $cg/init
  for p in $(cat $cg/cgroup.procs); do echo "$p" >$cg/init/cgroup.procs 2>/dev/null; done
  echo "+memory +pids" >$cg/cgroup.subtree_control || { echo "no memory controller"; exit 1; }
fi
limits=("$@"); [ ${#limits[@]} -eq 0 ] && limits=(4 16)
for gb in "${limits[@]}"; do
  total=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
  if [ $((gb * 4)) -gt $((total * 3)) ]; then
    echo "== ${gb}G skipped: over 3/4 of MemTotal (${total} GB) now"; continue
  fi
  d=$cg/probe-$gb; mkdir -p "$d"; echo "${gb}G" >"$d/memory.max"
  echo 0 >"$d/memory.swap.max" 2>/dev/null
  echo "== a hog under memory.max=${gb}G, 256 MiB steps at full speed"
  (echo $BASHPID >"$d/cgroup.procs"; exec timeout 120 python3 -u -c '
import time
c, t = [], time.time()
while True:
    c.append(bytearray(1 << 28)); c[-1][::4096] = b"x" * len(c[-1][::4096])
    if len(c) % 8 == 0:
        m = {l.split(":")[0]: int(l.split()[1]) >> 10 for l in open("/proc/meminfo") if l.startswith(("MemTotal", "MemAvailable"))}
        print(f"{len(c) // 4} GB in {time.time() - t:.1f} s; {m}", flush=True)
')
  echo "hog exit $? (137: killed); memory.events: $(tr '\n' ' ' <"$d/memory.events"); $(mem)"
done
