#!/usr/bin/env bash
# One GPU: the pipeline's multi-GPU code run on a single GPU, ahead of the two-GPU run issue 15 still needs
# (benchmarks/gpu/parallel_h200x2.sh). Run from the repository root with the FFI libraries in jax_dwdp/_lib (built
# on the CPU machine, carried). Steps ($STEPS, default "tests rehearsal"):
#   tests      tests/test_gpu.py whole (its two pipeline-stages-on-one-GPU tests among them), then tests/test_scan.py
#              on the GPU ($SCAN_TESTS=0 skips it; a CPU module: with one GPU its multi-device tests skip, the rest
#              run the scanned stack on the GPU against fp32 bounds calibrated on the CPU)
#   rehearsal  bench_pipeline.py --same-device: $LAYERS layers of 35b-a3b (default 16 on an H100, 24 on an H200: the
#              one-device model and the two stages are both on this GPU), microbatches ($MICRO, default "4 8") of
#              one $SEQ-token sequence (default 8192), two stages, layer-wise then scanned: the pipeline driver's
#              time (stage threads, and one thread) against the one-device run of the same microbatches; ideal 1.0
# Each command's limit is cut to what is left of $DEADLINE seconds (default 570; _limits.sh). Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests rehearsal"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source benchmarks/gpu/_limits.sh
LAYERS=${LAYERS:-$(by_memory 24 16)}
SEQ=${SEQ:-8192}
MICRO=${MICRO:-"4 8"}
ls -la jax_dwdp/_lib
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    tests)
      echo "== tests/test_gpu.py"
      timeout $(limit ${TEST_TIMEOUT:-240}) python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        > "$OUT/tests_gpu.log" 2>&1
      echo "rc $?"; grep -E "^GPU|passed|failed|FAILED|rror" "$OUT/tests_gpu.log" | tail -20
      if [ "${SCAN_TESTS:-1}" = 1 ] && time_for "tests/test_scan.py"; then
        echo "== tests/test_scan.py on the GPU"
        timeout $(limit ${SCAN_TIMEOUT:-150}) python3 -m pytest -q -rs -p no:cacheprovider --tb=short \
          tests/test_scan.py > "$OUT/tests_scan.log" 2>&1
        echo "rc $?"; grep -E "passed|failed|FAILED|^E  " "$OUT/tests_scan.log" | head -30
      fi ;;
    rehearsal)
      for scan in "" "--scan"; do
        time_for "rehearsal ${scan:-layer-wise}" || continue
        echo "== rehearsal ${scan:-layer-wise}: $LAYERS layers, $SEQ tokens per microbatch, microbatches $MICRO"
        timeout $(limit ${REHEARSAL_TIMEOUT:-200}) python3 benchmarks/bench_pipeline.py --same-device \
          --preset 35b-a3b --num-layers $LAYERS --seq-len $SEQ --microbatches $MICRO --iters 3 $scan \
          --out "$OUT/rehearsal${scan:+_scan}.json" 2>&1 | quiet | tee "$OUT/rehearsal${scan:+_scan}.log"
      done ;;
  esac
done
