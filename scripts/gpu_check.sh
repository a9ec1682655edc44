#!/usr/bin/env bash
# The checks and figures that need a GPU, in one run (docs/benchmarks.md "The
# model on a GPU"). Run from the repository root on a machine with a CUDA GPU whose python
# has torch with CUDA and the project's dependencies:
#   PYTHON=python3 bash scripts/gpu_check.sh [OUT] [STEP...]
# steps: env tests demo e2e roundtrip mps (default: all but mps, which starts an MPS
# control daemon for the roundtrip and e2e figures and stops it after them)
# Each step writes OUT/STEP.out (its stdout: JSON for demo and e2e) and OUT/STEP.log (its
# stderr), under a time limit; OUT/summary.json holds every step's exit status.
# E2E_ARGS: more options of `bench e2e` (say "--instances 1 --dops", one instance as on
# a GPU of its own); SEGMENT_TOKENS: its C (256).
set -u
OUT=${1:-gpu-check}
shift || true
STEPS=${*:-env tests demo e2e roundtrip}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A RC
# the modules that hold `gpu` tests (collecting only these needs none of the extras)
GPU_TEST_FILES="tests/test_gpu_path.py tests/test_model_device.py tests/test_dataplane.py tests/test_shm.py
  tests/test_attention.py tests/test_cluster_config.py tests/test_paged_plan.py"

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  RC[$name]=$?
  echo "   $name: exit ${RC[$name]} in $((SECONDS - t0)) s"
  tail -n 3 "$OUT/$name.out" "$OUT/$name.log" | cut -c1-300 | sed 's/^/   | /'
}

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv
  echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo not on the PATH)"
  "$PY" - <<'PY'
import json, torch
from tokenlake.deploy.gpu import gpu_setup
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name(0), **gpu_setup()}))
PY
}

under_mps() {  # the roundtrip and e2e figures again with an MPS control daemon of this run's own
  command -v nvidia-cuda-mps-control || { echo "nvidia-cuda-mps-control is not on the PATH" >&2; return 3; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/tokenlake-mps CUDA_MPS_LOG_DIRECTORY=/tmp/tokenlake-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 4
  trap 'echo quit | nvidia-cuda-mps-control' EXIT  # also when the step's time limit ends it
  local rc=0
  "$PY" -m tokenlake.tools.cli bench roundtrip --device cuda --json >"$OUT/mps_roundtrip.json" || rc=$?
  "$PY" -m tokenlake.tools.cli bench e2e --device cuda --kv-dtype bfloat16 \
    --segment-tokens "${SEGMENT_TOKENS:-256}" ${E2E_ARGS:-} --json >"$OUT/mps_e2e.json" || rc=$?
  cat "$CUDA_MPS_LOG_DIRECTORY"/*.log >&2
  return $rc
}

for s in $STEPS; do
  case $s in
    env) export -f environment; export PY; step env 60 bash -c environment ;;
    tests) step tests "${TESTS_LIMIT_S:-420}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
             -n "${TEST_WORKERS:-4}" ${TESTS_K:+-k "$TESTS_K"} ${TEST_FILES:-$GPU_TEST_FILES} ;;
    demo) step demo 240 "$PY" -m tokenlake.tools.cli demo --device cuda --kv-dtype bfloat16 --json ;;
    e2e) step e2e 300 "$PY" -m tokenlake.tools.cli bench e2e --device cuda --kv-dtype bfloat16 \
           --segment-tokens "${SEGMENT_TOKENS:-256}" ${E2E_ARGS:-} --json ;;
    mps) export -f under_mps; export PY OUT; step mps 300 bash -c under_mps ;;
    roundtrip) step roundtrip 180 "$PY" -m tokenlake.tools.cli bench roundtrip --device cuda --json ;;
    *) echo "unknown step $s"; RC[$s]=2 ;;
  esac
done
{
  printf "{"
  sep=""
  for k in "${!RC[@]}"; do printf '%s"%s": %s' "$sep" "$k" "${RC[$k]}"; sep=", "; done
  echo "}"
} >"$OUT/summary.json"
cat "$OUT/summary.json"
