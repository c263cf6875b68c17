#!/usr/bin/env bash
# Users' own models on a GPU host, isolated, on the farm's defaults: one
# device call (about 8 minutes on the H200), nothing set by hand but the farm
# itself.
#
#   1. bubblewrap (and libseccomp) from Debian's packages in .deb/, unpacked
#      without an install step (the GPU image has neither): `dpkg-deb -x` into
#      a folder of its own, on PATH;
#   2. an embedded farm with one CUDA compile worker, FARM_SANDBOX=on (a
#      worker that cannot isolate refuses to start), planted secrets in its
#      environment;
#   3. a user's own two-layer MLP from a directory on no farm path, submitted
#      as a user would (`farm submit ./mymodel.py:make --input ... --wait`),
#      then fetched and loaded by a fresh process with `compiled()` and
#      compared with eager;
#   4. a hostile model that reads every /proc/*/environ it sees, the planted
#      secret files and the farm's ports: the job's error must hold none of
#      the secrets.
#
# Prepare here (CPU machine): `scripts/gpu_wheels.sh` (.whl/) and
#   mkdir -p .deb && (cd .deb && apt-get download bubblewrap libseccomp2 libcap2)
# Run with the device tool, carrying .whl and .deb:
#   bash scripts/gpu_users.sh      (results: $OUT/gpu_users.log, gpu_users-farm.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_users.log") 2>&1
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

# 1. The sandbox's tools, carried.
DEB=/tmp/debroot
rm -rf "$DEB" && mkdir -p "$DEB"
for f in .deb/*.deb; do [ -f "$f" ] && dpkg-deb -x "$f" "$DEB"; done
export PATH=$DEB/usr/bin:$PATH
export LD_LIBRARY_PATH=$DEB/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
stamp "bwrap: $(command -v bwrap) $(bwrap --version 2>&1)"
stamp "cgroup fs: $(stat -fc %T /sys/fs/cgroup 2>/dev/null); controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.gpu_users-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.gpu_users-installed
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())"
farm() { python3 -m farm.app.cli "$@"; }

# 2. The farm, with secrets a hostile model must not reach.
HOME_DIR=/tmp/farm-users
rm -rf "$HOME_DIR" && mkdir -p "$HOME_DIR/secrets"
echo "planted-aws-secret-$RANDOM$RANDOM" >"$HOME_DIR/secrets/aws"
SECRET=$(cat "$HOME_DIR/secrets/aws")
PORT=8765
export FARM_HOME=$HOME_DIR FARM_URL=http://127.0.0.1:$PORT
stamp "starting the embedded farm (FARM_EMBEDDED_DEVICES=cuda FARM_SANDBOX=on)"
AWS_SECRET_ACCESS_KEY=$SECRET FARM_ADMIN_TOKEN="admin-$SECRET" FARM_EMBEDDED_DEVICES=cuda \
  FARM_SANDBOX=on setsid python3 -m farm.app.cli serve --embedded --port $PORT \
  >"$HOME_DIR/serve.log" 2>&1 </dev/null &
SERVE=$!
finish() {
  kill -TERM -- "-$SERVE" 2>/dev/null; sleep 2; kill -KILL -- "-$SERVE" 2>/dev/null
  tar czf "$OUT/gpu_users-farm.tgz" -C "$HOME_DIR" serve.log logs 2>/dev/null
  stamp "done"
}
trap finish EXIT
head -n 3 "$HOME_DIR/serve.log" 2>/dev/null
ready=0
for _ in $(seq 240); do
  if ! kill -0 "$SERVE" 2>/dev/null; then stamp "farm exited"; tail -40 "$HOME_DIR/serve.log"; exit 1; fi
  if farm targets 2>/dev/null | grep -q cuda; then ready=1; break; fi
  sleep 1
done
stamp "farm ready=$ready"; head -n 5 "$HOME_DIR/serve.log"
[ "$ready" = 1 ] || { tail -40 "$HOME_DIR/serve.log"; exit 1; }

# 3. A user's own model, from a directory of the user's.
U=/tmp/user && rm -rf "$U" && mkdir -p "$U"
cat >"$U/mymodel.py" <<'EOF'
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make() -> nn.Module:
    torch.manual_seed(0)
    return MLP()
EOF
cat >"$U/hostile.py" <<'EOF'
import glob
import json
import os
import socket

from torch import nn


def make() -> nn.Module:
    got = {}
    for p in glob.glob("/proc/*/environ"):
        try:
            got[p] = open(p, "rb").read().decode("utf-8", "replace")[:2000]
        except OSError as exc:
            got[p] = f"refused: {exc.strerror}"
    for f in (os.environ.get("SNOOP_FILE", ""), "/tmp/farm-users/secrets/aws"):
        try:
            got[f] = open(f).read()
        except OSError as exc:
            got[f] = f"refused: {exc.strerror}"
    for port in (8765, 6379, 5432):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            got[f"port {port}"] = "connected"
        except OSError as exc:
            got[f"port {port}"] = f"refused: {exc.strerror or exc}"
    raise RuntimeError("SNOOP " + json.dumps(got))
EOF
cd "$U"
stamp "submit mymodel.py:make (float32[4,12])"
s0=$SECONDS
farm submit ./mymodel.py:make --name mymlp --version 1 --input 'float32[4,12]' --wait --timeout 420
stamp "submit rc=$? after $((SECONDS - s0)) s"
python3 - <<'EOF'
import time

import torch

t = time.perf_counter()
from farm.node import compiled  # noqa: E402

import mymodel  # noqa: E402

m = mymodel.make().cuda()
x = torch.randn(4, 12, device="cuda")
fast = compiled(m, model="mymlp", ref="1", example_inputs=[x])
y = fast(x)
torch.cuda.synchronize()
err = (y - m(x)).abs().max().item()
print(f"node: source={fast.source} reason={fast.reason!r} {fast!r} max_abs_err={err:.2e} "
      f"first result {time.perf_counter() - t:.2f} s")
EOF
stamp "node rc=$?"
stamp "submit hostile.py:make"
farm submit ./hostile.py:make --name hostile --version 1 --input 'float32[4,12]' --wait \
  --timeout 300 >"$OUT/gpu_users-hostile.txt" 2>&1
stamp "hostile submit rc=$? (a failed build is expected)"
grep -o "SNOOP.*" "$OUT/gpu_users-hostile.txt" | head -c 3000; echo
if grep -q "$SECRET" "$OUT/gpu_users-hostile.txt"; then
  stamp "HOSTILE: LEAKED the planted secret"
else
  stamp "hostile: the planted secret did not leak"
fi
cd - >/dev/null
farm jobs 2>/dev/null | head -20
