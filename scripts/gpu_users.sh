#!/usr/bin/env bash
# Users' own models on a GPU host, isolated, on the farm's defaults, with
# nothing set by hand but the farm itself:
#
#   1. bubblewrap (and libseccomp) from Debian's packages in .deb/, unpacked
#      without an install step (the GPU image has neither): `dpkg-deb -x` into
#      a folder of its own, on PATH; a delegated cgroup for the builds' kernel
#      limits where the host's cgroup v2 lets us make one;
#   2. an embedded farm with one CUDA compile worker, FARM_SANDBOX=on (a
#      worker that cannot isolate refuses to start), planted secrets in its
#      environment;
#   3. a user's own two-layer MLP, a transformers LlamaForCausalLM (bf16,
#      keyword inputs) and a training step of the MLP (loss and AdamW) from a
#      directory on no farm path, submitted as a user would (`farm submit
#      ./mymodel.py:make --input ... --wait`), each fetched and loaded by a
#      fresh process (`compiled()`, `compiled_train_step`) and compared with eager;
#   4. hostile models (environment and secrets, writes outside the build,
#      ports, a fork bomb, a memory hog, a tmpfs burst) on the CUDA worker:
#      each must fail its own build, the planted secret must not appear in
#      any job's error, no file may appear outside the sandbox, and the
#      farm must still build after them. A table of results at the end.
#
# Prepare here (CPU machine): `scripts/gpu_wheels.sh` (.whl/, pyseccomp among
# them), the transformers wheels in .whl-hf/ (see scripts/gpu_wheels.sh hf) and
#   mkdir -p .deb && (cd .deb && apt-get download bubblewrap libseccomp2 libcap2)
# Run with the device tool, carrying .whl, .whl-hf and .deb; a whole run is
# longer than one call, so it runs detached across calls:
#   bash scripts/gpu_users.sh start; bash scripts/gpu_users.sh wait 540
#   bash scripts/gpu_users.sh wait 570        (again, until it says done)
# (results: $OUT/gpu_users.log, gpu_users-*.txt, gpu_users-farm.tgz)
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-run}
DETACHED=/tmp/gpu_users-detached
case "$PHASE" in
  run) ;;
  start)
    # Its own copy of the tree: the device tool replaces the carried tree at
    # every call, which would pull the files from under a run started earlier.
    rm -rf "$DETACHED" && mkdir -p "$DETACHED/tree"
    cp -a . "$DETACHED/tree/"
    OUT="$DETACHED" setsid nohup bash "$DETACHED/tree/scripts/gpu_users.sh" run \
      >"$DETACHED/nohup.out" 2>&1 </dev/null &
    echo $! >"$DETACHED/pid"
    echo "gpu_users started detached (pid $!), writing to $DETACHED"
    exit 0;;
  wait)
    pid=$(cat "$DETACHED/pid" 2>/dev/null) || { echo "no detached run (start one)"; exit 2; }
    end=$((SECONDS + ${2:-570}))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    if [ -n "${OUT:-}" ]; then cp "$DETACHED"/*.txt "$DETACHED"/*.out "$DETACHED"/*.log "$DETACHED"/*.tgz "$OUT"/ 2>/dev/null; fi
    tail -n 60 "$DETACHED/gpu_users.log" 2>/dev/null
    if kill -0 "$pid" 2>/dev/null; then echo "still running (pid $pid): wait again"; exit 75; fi
    exit 0;;
  *) echo "usage: $0 [run|start|wait [S]]" >&2; exit 2;;
esac
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_users.log") 2>&1
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

# 1. The sandbox's tools and the farm's dependencies, carried; transformers
# only where the image lacks it.
. scripts/gpu_carried.sh
use_carried_debs
hf=.whl-hf
python3 -c "import transformers" 2>/dev/null && hf=
install_carried_wheels .whl $hf || exit 1
delegate_build_cgroup
[ -z "${FARM_BUILD_CGROUP:-}" ] && [ -n "$BUILD_CGROUP" ] && export FARM_BUILD_CGROUP=$BUILD_CGROUP
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

# 3. Users' own models, from a directory of the user's.
U=/tmp/user && rm -rf "$U" && mkdir -p "$U"
cat >"$U/mymodel.py" <<'PY'
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
PY
cat >"$U/myllama.py" <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256, use_cache=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
PY
# Hostile models, each aimed at the CUDA compile worker: under the trace (a
# CPU step on a farm of several hosts) each builds a plain MLP, so the job
# reaches the compile worker; there (its children have imported the farm's
# compile or verify step before they build the model) it attacks and reports what it reached in
# its error (SNOOP ...). A job that succeeds never attacked: the table says so.
HOSTILE_HEAD='import glob, json, os, socket, time
import torch
from torch import nn


def plain() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4))


def on_compile_worker() -> bool:
    # A compile or verify child has imported the farm compile step before
    # it builds the model; a trace child has not. (TORCHINDUCTOR_CACHE_DIR
    # was no sign: the trace child on the GPU host had it too.)
    import sys
    return "farm.build.compile" in sys.modules or "farm.build.verify" in sys.modules


def where() -> str:
    return f"cuda={torch.cuda.is_available()} pid={os.getpid()} uid={os.getuid()}"
'
{ echo "$HOSTILE_HEAD"; cat <<'PY'
def make() -> nn.Module:
    if not on_compile_worker():
        return plain()
    got = {"where": where()}
    for p in glob.glob("/proc/*/environ"):
        try:
            got[p] = open(p, "rb").read().decode("utf-8", "replace")[:2000]
        except OSError as exc:
            got[p] = f"refused: {exc.strerror}"
    for f in ("/tmp/farm-users/secrets/aws", "/tmp/farm-users/farm.db", "/root/.bash_history",
              "/tmp/farm-users/builder-key.pem"):
        try:
            got[f] = open(f, "rb").read(200).decode("utf-8", "replace")
        except OSError as exc:
            got[f] = f"refused: {exc.strerror}"
    for port in (8765, 6379, 5432):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            got[f"port {port}"] = "connected"
        except OSError as exc:
            got[f"port {port}"] = f"refused: {exc.strerror or exc}"
    raise RuntimeError("SNOOP " + json.dumps(got))
PY
} >"$U/hostile_env.py"
{ echo "$HOSTILE_HEAD"; cat <<'PY'
def make() -> nn.Module:
    if not on_compile_worker():
        return plain()
    got = {"where": where()}
    for f in ("/tmp/farm-users/PWNED", "/tmp/PWNED-host", os.path.expanduser("~/PWNED"),
              "/usr/PWNED", "/work/PWNED"):
        try:
            with open(f, "w") as fh:
                fh.write("pwned")
            got[f] = "written (inside the sandbox's own view)"
        except OSError as exc:
            got[f] = f"refused: {exc.strerror}"
    raise RuntimeError("SNOOP " + json.dumps(got))
PY
} >"$U/hostile_write.py"
{ echo "$HOSTILE_HEAD"; cat <<'PY'
def make() -> nn.Module:
    if not on_compile_worker():
        return plain()
    n = 0
    try:
        for _ in range(20000):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
    except OSError as exc:
        raise RuntimeError(f"SNOOP {where()} fork bomb stopped after {n} processes: {exc}")
    raise RuntimeError(f"SNOOP {where()} fork bomb NOT stopped: {n} processes")
PY
} >"$U/hostile_fork.py"
# The memory models grow by 256 MiB a step, about 1 GB/s: the limit (kernel or
# watchdog) must see them, and a machine whose RAM grows on demand can follow.
{ echo "$HOSTILE_HEAD"; cat <<'PY'
def make() -> nn.Module:
    if not on_compile_worker():
        return plain()
    chunks = []
    while True:  # touch every page: the limit must see it
        chunks.append(bytearray(1 << 28))
        chunks[-1][::4096] = b"x" * len(chunks[-1][::4096])
        time.sleep(0.2)
PY
} >"$U/hostile_hog.py"
{ echo "$HOSTILE_HEAD"; cat <<'PY'
def make() -> nn.Module:
    if not on_compile_worker():
        return plain()
    block = b"x" * (1 << 28)
    i = 0
    while True:  # tmpfs pages are memory too
        with open(f"/dev/shm/burst-{i}", "wb") as fh:
            fh.write(block)
        i += 1
        time.sleep(0.2)
PY
} >"$U/hostile_tmpfs.py"
cd "$U"
# Both users' models at once, each as a user types it.
# GPU_USERS_MODELS=0 leaves them out (a run for the hostile suite alone).
if [ "${GPU_USERS_MODELS:-1}" = 1 ]; then
stamp "submit mymodel.py:make and myllama.py:make"
( s0=$SECONDS; farm submit ./mymodel.py:make --name mymlp --version 1 --input 'float32[4,12]' \
    --wait --timeout 540; echo "rc=$? after $((SECONDS - s0)) s" ) >"$OUT/gpu_users-mlp.txt" 2>&1 &
MLP=$!
# GPU_USERS_LLAMA_OPTIONS: more submit options for the Llama (e.g. --per-block).
# shellcheck disable=SC2086
( s0=$SECONDS; farm submit ./myllama.py:make --name myllama --version 1 \
    --input 'input_ids=int64[1,16]' --input 'attention_mask=int64[1,16]{0..1}' \
    ${GPU_USERS_LLAMA_OPTIONS:-} --wait --timeout 900; echo "rc=$? after $((SECONDS - s0)) s" ) >"$OUT/gpu_users-llama.txt" 2>&1 &
LLAMA=$!
# And a training step of the same MLP (its loss and optimizer compiled with
# its backward), beside them.
( s0=$SECONDS; farm submit ./mymodel.py:make --name mymlp-train --version 1 \
    --input 'float32[4,12]' --input 'float32[4,4]' --loss torch.nn.functional:mse_loss \
    --optimizer AdamW --wait --timeout 600; echo "rc=$? after $((SECONDS - s0)) s" ) \
    >"$OUT/gpu_users-train.txt" 2>&1 &
TRAIN=$!
wait $MLP; stamp "mlp: $(tail -n 1 "$OUT/gpu_users-mlp.txt")"
grep -E "error|failed|compiling|verifying" "$OUT/gpu_users-mlp.txt" | head -8
python3 - <<'PY'
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
print(f"node mlp: {fast!r} max_abs_err={err:.2e} first result {time.perf_counter() - t:.2f} s")
PY
stamp "node mlp rc=$?"
wait $LLAMA; stamp "llama: $(tail -n 1 "$OUT/gpu_users-llama.txt")"
grep -E "error|failed|compiling|verifying" "$OUT/gpu_users-llama.txt" | head -8
python3 - <<'PY'
import time

import torch

t = time.perf_counter()
from farm.node import compiled  # noqa: E402

import myllama  # noqa: E402

m = myllama.make().cuda()
ids = torch.randint(0, 1000, (1, 16), device="cuda")
mask = torch.ones(1, 16, dtype=torch.int64, device="cuda")
mask[0, :3] = 0
fast = compiled(m, model="myllama", ref="1",
                example_inputs=["input_ids=int64[1,16]", "attention_mask=int64[1,16]{0..1}"])
with torch.no_grad():
    y = fast(input_ids=ids, attention_mask=mask)
    ref = m(input_ids=ids, attention_mask=mask)
torch.cuda.synchronize()
err = (y.logits.float() - ref.logits.float()).abs().max().item()
print(f"node llama: {fast!r} max_abs_err={err:.2e} (bf16) first result "
      f"{time.perf_counter() - t:.2f} s")
PY
stamp "node llama rc=$?"
wait $TRAIN; stamp "train: $(tail -n 1 "$OUT/gpu_users-train.txt")"
grep -E "error|failed|compiling|verifying" "$OUT/gpu_users-train.txt" | head -8
python3 - <<'PY'
import copy
import time

import torch

t = time.perf_counter()
from farm.core.specs import GradMode  # noqa: E402
from farm.core.target import detect_local_target  # noqa: E402
from farm.node.client import FarmClient  # noqa: E402
from farm.node.training import compiled_train_step, eager_train_step, train_spec_of  # noqa: E402

import mymodel  # noqa: E402

model = mymodel.make().cuda()
reference = copy.deepcopy(model)
client = FarmClient()
resolved = client.resolve("mymlp-train", "1", ["float32[4,12]", "float32[4,4]"],
                          GradMode.TRAINING, detect_local_target("cuda"))
step = compiled_train_step(client, resolved, model)
eager = eager_train_step(reference, train_spec_of(resolved["artifact"]))
errs = []
for k in range(3):
    g = torch.Generator(device="cuda").manual_seed(100 + k)
    x = torch.randn(4, 12, device="cuda", generator=g)
    y = torch.randn(4, 4, device="cuda", generator=g)
    loss, loss_ref = step(x, y), eager(x, y)
    if k == 0:
        torch.cuda.synchronize()
        first = time.perf_counter() - t
    errs.append(abs(float(loss) - float(loss_ref)))
params = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                       reference.parameters()))
print(f"node train: source={step.source} loss errors vs eager {[f'{e:.1e}' for e in errs]} "
      f"max param err after 3 steps {params:.2e} first step {first:.2f} s")
PY
stamp "node train rc=$?"
fi

# 4. Hostile models on the CUDA worker, one after another (one compile worker).
TABLE=$OUT/gpu_users-hostile.txt
echo "| hostile model | farm submit | what the job reported (first 300 chars) |" >"$TABLE"
echo "|---|---|---|" >>"$TABLE"
# Within the budget gpu_check.sh gives (GPU_USERS_BUDGET_S): a model that
# would not fit is listed as not run.
USERS_END=$(( ${GPU_USERS_BUDGET_S:-100000} ))
# GPU_USERS_HOSTILE picks them (a memory hog once stopped a lent machine, so a
# run that must bring back its other results leaves it to the end).
for h in ${GPU_USERS_HOSTILE-env write fork hog tmpfs}; do
  if [ $((USERS_END - SECONDS)) -lt 90 ]; then
    echo "| $h | not run: the check's budget ran out | |" >>"$TABLE"
    continue
  fi
  s0=$SECONDS
  farm submit "./hostile_$h.py:make" --name "hostile-$h" --version 1 --input 'float32[4,12]' \
    --wait --timeout 300 >"$OUT/gpu_users-hostile-$h.out" 2>&1
  rc=$?
  msg=$(grep -m1 -E "error: " "$OUT/gpu_users-hostile-$h.out" | head -c 300 | tr '|\n' '/ ')
  echo "| $h | rc=$rc after $((SECONDS - s0)) s | $msg |" >>"$TABLE"
  stamp "hostile $h: rc=$rc"
done
leak=no
grep -rq "$SECRET" "$OUT"/gpu_users-hostile-*.out && leak=YES
stamp "the planted secret in any hostile job's output: $leak"
for f in /tmp/farm-users/PWNED /tmp/PWNED-host ~/PWNED /usr/PWNED /work/PWNED; do
  [ -e "$f" ] && stamp "HOSTILE WRITE LANDED: $f"
done
cat "$TABLE"
grep -ho "SNOOP.*" "$OUT"/gpu_users-hostile-*.out | cut -c1-1500
# The farm still builds after them.
farm submit ./mymodel.py:make --name mymlp --version 2 --input 'float32[8,12]' --wait \
  --timeout 300 >"$OUT/gpu_users-after.txt" 2>&1
stamp "a build after the hostile ones: rc=$?"
cd - >/dev/null
farm jobs 2>/dev/null | head -20
