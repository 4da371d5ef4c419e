#!/usr/bin/env bash
# The GPU machine's run for issue 43, at most 8 minutes, results under $OUT.
#
# Prepared here by scripts/gpu_carry.sh (build/gpu-carry/: CPython 3.12 wheels of the
# server's dependencies the GPU image lacks, and Debian's redis-server 7.0 with the two
# libraries it may miss); the device tool runs, in the repository root:
#
#   bash scripts/gpu_does_it_pay.sh          (carry: build/gpu-carry; timeout_s 540)
#
# The image has Python 3.12 with torch and transformers, no lmcache, no internet. Steps,
# each under its own time limit so the whole stays within 8 minutes:
#  1. install the carried wheels into /tmp/site (20 s), compile the Cython twins in place
#     (setup.py build_ext, at most 90 s; if it fails the server runs pure Python, and
#     env.txt says which);
#  2. our server on the same machine (memory backend, loopback), then
#     `epistemic-kvcache does-it-pay` for Llama-3-8B and Llama-3-70B (tensor-parallel over
#     4 GPUs: one rank's share, measured on this one GPU), every path that runs without
#     lmcache (mp-native: our L2 connector driven as LMCache's adapter drives it; client:
#     our Python client; the LMCache paths are recorded as skipped), prompt lengths
#     256-32768 (at most 190 s);
#  3. bench.bench_loops: 1/2/4/8/16 event loops at 256 KiB and 4 MiB, against
#     redis-server and redis-server --io-threads 4, 8 load-generator processes x 8
#     connections (at most 130 s).
# Outputs: $OUT/env.txt, $OUT/dip/does-it-pay.json and .png, $OUT/dip.log, $OUT/loops.md.
# DIP_ARGS, LOOPS_ARGS and SKIP_COMPILE=1 change steps 1-3 for a smoke run on a CPU.
# Back here: scripts/gen_does_it_pay.py --run <dip json> --loops <loops.md> regenerates
# docs/does-it-pay.md with the card named.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
CARRY=build/gpu-carry
T0=$(date +%s)
since() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/env.txt"; }

export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  echo "nproc $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB RAM"}'); load $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} >"$OUT/env.txt" 2>&1

# 1. dependencies and the compiled twins
timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$CARRY"/wheels/*.whl >>"$OUT/env.txt" 2>&1 || since "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export PATH=$PWD/$CARRY/redis/bin:$PATH
missing=$(ldd "$CARRY/redis/bin/redis-server" | awk '/not found/ {print $1}')
if [ -n "$missing" ]; then  # only the libraries the image lacks, from Debian's packages
  mkdir -p /tmp/redis-lib
  for lib in $missing; do ln -sf "$PWD/$CARRY/redis/lib/$lib" /tmp/redis-lib/; done
  export LD_LIBRARY_PATH=/tmp/redis-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
redis-server --version >>"$OUT/env.txt" 2>&1 || since "redis-server does not run"
if ! command -v ss >/dev/null; then  # bench_cpu.pid_listening asks ss
  mkdir -p /tmp/shim && ln -sf "$PWD/scripts/ss_shim.py" /tmp/shim/ss && export PATH=/tmp/shim:$PATH
  since "no ss here: scripts/ss_shim.py stands in"
fi
if [ -z "${SKIP_COMPILE:-}" ]; then
  since "compiling the twins"
  timeout 90 $PY setup.py -q build_ext --inplace -j 16 >"$OUT/compile.log" 2>&1 \
    || since "compile failed or timed out (the server runs pure Python): see compile.log"
fi
$PY -c 'from epistemic_kvcache.proto import resp_framer as f; from epistemic_kvcache.store import core; from epistemic_kvcache.server.resp import fast; print("twins:", f.IMPLEMENTATION, core.IMPLEMENTATION, fast.IMPLEMENTATION)' >>"$OUT/env.txt" 2>&1

# 2. our server and does-it-pay
TOKEN=gpu-does-it-pay-token-0123456789abcdef
$PY -m epistemic_kvcache serve --backend memory --hot-capacity-bytes 24GiB --warm-capacity-bytes 0 \
  --max-block-bytes 64MiB --addr 127.0.0.1:0 --resp-addr 127.0.0.1:0 --token "$TOKEN" \
  --persist-dir /tmp/kv --stats-log-interval-s 0 >"$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "listening resp=" "$OUT/server.log" && break; sleep 0.2; done
HTTP=$(grep -o "listening http=[^ ]*" "$OUT/server.log" | head -1 | cut -d= -f2)
RESP=$(grep -o "listening resp=[^ ]*" "$OUT/server.log" | head -1 | cut -d= -f2)
since "server http=$HTTP resp=$RESP; does-it-pay"
DIP_ARGS=${DIP_ARGS:---model llama-3-8b --model llama-3-70b}
# shellcheck disable=SC2086
timeout 190 $PY -m epistemic_kvcache does-it-pay $DIP_ARGS \
  --url "http://$HTTP" --resp-addr "$RESP" --token "$TOKEN" --out "$OUT/dip" >"$OUT/dip.log" 2>&1 \
  || since "does-it-pay exited $? (a run stopped early keeps the models it finished)"
kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null

# 3. event-loop scaling against redis-server
since "bench_loops"
LOOPS_ARGS=${LOOPS_ARGS:---sizes 256KiB,4MiB --loops 1,2,4,8,16 --procs 8 --conns 8 --budget-mib 256 --redis-io-threads 4}
# shellcheck disable=SC2086
timeout 130 $PY -m bench.bench_loops $LOOPS_ARGS >"$OUT/loops.md" 2>"$OUT/loops.err" \
  || since "bench_loops exited $? (rows printed so far are in loops.md)"
since "done"
