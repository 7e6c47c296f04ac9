#!/usr/bin/env bash
# One H200: the routing / permutation / conv kernels' GPU tests and the bf16 model test, then where a layer's time goes
# (bench_layer_parts.py at 4K-32K) and the 40-layer 35b-a3b prefill with the default kernels and (BEFORE=1) with
# BEFORE_ENV (default: the XLA routing and conv they replaced), with --scan (SCAN=1) and transformers' prefill
# (HF=1: fla from .whl/ installed under /tmp/site), in one run. Logs, JSON under $OUT. Knobs: TESTS, TEST_ARGS
# (pytest arguments), PARTS, PARTS_ARGS, MODEL40, MODEL40_SEQ, MODEL40_ARGS (e.g. --trace "$OUT/trace"), MODEL40_LINES,
# BEFORE, BEFORE_ENV, BEFORE_SEQ, SCAN, SCAN_SEQ, HF, HF_SEQ.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
quiet() { grep -v "^\s*@\|^E1[0-9]*\|^W1[0-9]*\|^\*\*\*\|slow_operation\|Very slow\|^$\|Warning\|warn(\|^\s*%\|^\s*}\|^external\|^  ROOT"; }
if [ "${TESTS:-1}" = 1 ]; then
  JAX_DWDP_TEST_GPU=1 timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider ${TEST_ARGS:-tests/test_routing.py tests/test_permute.py \
    tests/test_conv.py tests/test_gpu.py::test_gpu_bf16_prefill_runs_the_fast_kernels \
    tests/test_gpu.py::test_gpu_prefill_matches_cpu_fp32} 2>&1 | tee "$OUT/tests.log" \
    | grep -E "err|order ==|vs fp32|vs CPU|passed|failed|Error" | tail -${TEST_LINES:-40}
  grep -q " failed\|[0-9] error" "$OUT/tests.log" && { echo "GPU tests failed: benchmarks skipped"; exit 1; }
  grep -q " passed" "$OUT/tests.log" || { echo "GPU tests did not finish (TEST_TIMEOUT?): benchmarks skipped"; exit 1; }
fi
if [ "${PARTS:-1}" = 1 ]; then
  timeout ${PARTS_TIMEOUT:-240} python3 benchmarks/bench_layer_parts.py ${PARTS_ARGS:---tokens 4096 16384 32768 \
    --no-attention-alternatives --fusions} --out "$OUT/parts.json" 2>&1 | quiet | tee "$OUT/parts.log"
fi
if [ "${MODEL40:-1}" = 1 ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${MODEL40_TIMEOUT:-200} python3 benchmarks/bench_prefill.py \
    --preset 35b-a3b --seq-lens ${MODEL40_SEQ:-4096 16384 32768} --layerwise --iters 5 ${MODEL40_ARGS:-} \
    --out "$OUT/prefill40.json" 2>&1 | quiet | tee "$OUT/prefill40.log" | tail -${MODEL40_LINES:-5} | sed "s/^/default: /"
  if [ "${BEFORE:-1}" = 1 ]; then
    # BEFORE_ENV: space-separated VAR=value words (no spaces inside a value)
    before_env=${BEFORE_ENV-JAX_DWDP_ROUTING=xla JAX_DWDP_CONV=xla}
    (set -f; env $before_env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
      timeout ${MODEL40_TIMEOUT:-200} python3 benchmarks/bench_prefill.py --preset 35b-a3b \
      --seq-lens ${BEFORE_SEQ:-16384} --layerwise --iters 5 --out "$OUT/prefill40_before.json") 2>&1 | quiet | tail -3 \
      | awk -v p="${before_env:-unchanged}" '{print p ": " $0}'
  fi
fi
if [ "${SCAN:-0}" = 1 ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${MODEL40_TIMEOUT:-200} python3 benchmarks/bench_prefill.py \
    --preset 35b-a3b --seq-lens ${SCAN_SEQ:-4096 16384 32768} --scan --iters 5 --out "$OUT/prefill40_scan.json" \
    2>&1 | quiet | tail -5 | sed "s/^/scan: /"
fi
if [ "${HF:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 \
    || { echo "HF=1: installing .whl/*.whl (fla) failed, see pip.log"; exit 1; }
  PYTHONPATH=$PWD:/tmp/site timeout ${HF_TIMEOUT:-300} python3 benchmarks/bench_transformers.py --preset 35b-a3b \
    --seq-lens ${HF_SEQ:-4096 16384} --iters 3 --out "$OUT/prefill40_transformers.json" 2>&1 | quiet | tail -5 \
    | sed "s/^/transformers: /"
fi
source benchmarks/gpu/_bundle_out.sh
bundle_out "$OUT"  # past 8 files, one $OUT/logs.tgz (the device tool returns at most 8)
