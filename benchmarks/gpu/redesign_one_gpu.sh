#!/usr/bin/env bash
# One GPU, the engine after its redesign (issue 45: backends, execution modes, kernel choices as data) and the Gated
# DeltaNet chunk's matmul inverse (issue 43). Steps ($STEPS, default "ab gdn kernels"):
#   ab       the 40-layer 35b-a3b prefill at 16K (bench_prefill.py --layerwise, 10 calls a round), the tree before
#            the redesign ($BEFORE, default ../.gpu_before: `git archive ad844b1 jax_dwdp benchmarks tests` with its
#            jax_dwdp/_lib) against this one, $ROUNDS (default 2) rounds in turn (benchmarks/gpu/ab_prefill.sh)
#   gdn      the inverse's test, tests/test_gpu_gdn.py (Pallas kernels vs the XLA reference), and
#            benchmarks/probe_gdn_inverse.py (the solve as matmuls vs cuBLAS's trsm at 4K / 16K)
#   kernels  the kernel-choice and kernel tests on the GPU: tests/test_kernel_choice.py, test_conv.py,
#            test_routing.py, test_norm_rope.py, test_permute.py
# Run from the repository root with jax_dwdp/_lib carried. Each command's limit is cut to what is left of $DEADLINE
# seconds (default 570; _limits.sh). Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"ab gdn kernels"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source benchmarks/gpu/_limits.sh
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    ab)
      echo "== before vs now, 40 layers of 35b-a3b at 16K"
      VARIANTS="before:${BEFORE:-../.gpu_before}: now:.:" ROUNDS=${ROUNDS:-2} DEADLINE=$((DEADLINE - SECONDS)) \
        OUT="$OUT/ab" bash benchmarks/gpu/ab_prefill.sh 2>&1 | tail -8 ;;
    gdn)
      echo "== inverse test, tests/test_gpu_gdn.py; probe_gdn_inverse"
      JAX_DWDP_TEST_GPU=1 PYTHONPATH=$PWD timeout "$(limit 200)" python3 -m pytest -q -rs -p no:cacheprovider \
        "tests/test_host_devices.py::test_unit_lower_inverse_equals_float64_inverse" tests/test_gpu_gdn.py \
        > "$OUT/gdn_tests.log" 2>&1
      echo "rc $?"; grep -E "passed|failed|FAILED" "$OUT/gdn_tests.log" | tail -5
      PYTHONPATH=$PWD timeout "$(limit 120)" python3 benchmarks/probe_gdn_inverse.py --seq-lens 4096 16384 \
        --out "$OUT/gdn_inverse.json" 2>&1 | quiet | tail -6 ;;
    kernels)
      echo "== kernel choices and kernels"
      JAX_DWDP_TEST_GPU=1 PYTHONPATH=$PWD timeout "$(limit 400)" python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_kernel_choice.py tests/test_conv.py tests/test_routing.py tests/test_norm_rope.py \
        tests/test_permute.py > "$OUT/kernel_tests.log" 2>&1
      echo "rc $?"; grep -E "passed|failed|FAILED" "$OUT/kernel_tests.log" | tail -8 ;;
  esac
done
