#!/usr/bin/env bash
# One H200: GPU tests of the model and kernels, then the 35b-a3b prefill benchmark. Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
JAX_DWDP_TEST_GPU=1 timeout 150 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[transformers\]" | tail -25
# 4 layers first: compile time per layer and per-layer speed, cheaply.
timeout 100 python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers 4 --seq-lens 4096 16384 --iters 5 \
  --out "$OUT/prefill_35b_a3b_4layers.json" 2>&1 | tee "$OUT/bench_prefill_4layers.log"
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens 4096 16384 \
  --iters 5 --out "$OUT/prefill_35b_a3b.json" 2>&1 | tee "$OUT/bench_prefill.log"
