#!/usr/bin/env bash
# One H200: the Pallas gated delta rule's GPU tests (and the bf16 model test that checks the model calls it), the
# kernel benchmark against flash-linear-attention 0.6 (carried as wheels in .whl/: flash-linear-attention, fla-core),
# then an 8-layer 35b-a3b prefill at 16K tokens with the XLA and the Pallas gated delta rule. Logs, JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
quiet() { grep -v "^\s*@\|^E1130\|^\*\*\*\|slow_operation\|Very slow\|^$\|Warning\|warn(\|^variant"; }
if [ "${GDN_TESTS:-1}" = 1 ]; then
  JAX_DWDP_TEST_GPU=1 timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu_gdn.py \
    tests/test_gpu.py::test_gpu_bf16_prefill_runs_the_fast_kernels -q -s -p no:cacheprovider ${GDN_TEST_K:+-k "$GDN_TEST_K"} 2>&1 \
    | tee "$OUT/gdn_tests.log" | grep -E "seq 0|T=|pieces|vs fp32|passed|failed|Error" | tail -${GPU_TEST_LINES:-30}
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-160} python3 benchmarks/bench_gdn.py ${BENCH_ARGS:---variants --no-xla} \
    --out "$OUT/gdn_h200.json" 2>&1 | tee "$OUT/bench_gdn.log" | quiet | grep "^|\|^best\|rror" | tail -20
fi
if [ "${MODEL:-1}" = 1 ]; then
  for impl in xla pallas; do
    JAX_DWDP_GDN=$impl timeout ${MODEL_TIMEOUT:-60} python3 benchmarks/bench_prefill.py --preset 35b-a3b \
      --num-layers ${MODEL_LAYERS:-8} --seq-lens 16384 --layerwise --iters 3 --out "$OUT/prefill_gdn_$impl.json" \
      2>&1 | quiet | tail -3 | sed "s/^/gdn=$impl: /"
  done
fi
# MODEL40=1: the whole 35b-a3b model (40 layers) at 4K and 16K tokens, layer-wise, XLA then Pallas gated delta rule,
# in one run (the before / after).
if [ "${MODEL40:-0}" = 1 ]; then
  for impl in ${MODEL40_IMPLS:-xla pallas}; do
    JAX_DWDP_GDN=$impl XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${MODEL40_TIMEOUT:-240} python3 \
      benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens 4096 16384 --layerwise --iters 5 \
      --out "$OUT/prefill40_gdn_$impl.json" 2>&1 | quiet | tail -4 | sed "s/^/gdn=$impl: /"
  done
fi
