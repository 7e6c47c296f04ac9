#!/usr/bin/env bash
# One GPU: the XLA path of the Gated DeltaNet chunk (the fp32 reference, and the path of every fp32 GPU test) with
# its triangular solve as matmuls (gated_delta_rule.unit_lower_inverse). Steps ($STEPS, default "tests probe"):
#   tests  the inverse's own test, tests/test_gpu_gdn.py (Pallas kernel vs the XLA reference) and tests/test_gpu.py
#   probe  benchmarks/probe_gdn_inverse.py: the solve as matmuls vs cuBLAS's trsm, side by side, 4K and 16K tokens
# Run from the repository root with the FFI libraries in jax_dwdp/_lib (built on the CPU machine, carried). Each
# command's limit is cut to what is left of $DEADLINE seconds (default 570; _limits.sh). Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests probe"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
source benchmarks/gpu/_limits.sh
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    tests)
      echo "== inverse test, tests/test_gpu_gdn.py, tests/test_gpu.py"
      timeout $(limit ${TEST_TIMEOUT:-360}) python3 -m pytest -q -rs -s -p no:cacheprovider \
        "tests/test_host_devices.py::test_unit_lower_inverse_equals_float64_inverse" tests/test_gpu_gdn.py \
        tests/test_gpu.py > "$OUT/tests_gpu.log" 2>&1
      echo "rc $?"; grep -E "^GPU|relative error|passed|failed|FAILED|rror" "$OUT/tests_gpu.log" | tail -25 ;;
    probe)
      echo "== probe_gdn_inverse"
      timeout $(limit ${PROBE_TIMEOUT:-120}) python3 benchmarks/probe_gdn_inverse.py --seq-lens 4096 16384 \
        --out "$OUT/gdn_inverse.json" 2>&1 | quiet | tee "$OUT/gdn_inverse.log" ;;
  esac
done
