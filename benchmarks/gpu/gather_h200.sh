#!/usr/bin/env bash
# One H200: the gate_up grouped GEMM that gathers the tokens itself (ffi/grouped_gemm/gather_gemm.cuh, issue 15).
# Run from the repository root with the library built into jax_dwdp/_lib (carried, or built here by cmake when
# BUILD=1). Steps ($STEPS, default "tests bench prefill"):
#   tests    its GPU tests (tests/test_gather_gemm.py) and the grouped matmul's (tests/test_grouped_matmul.py)
#   bench    bench_grouped_matmul.py gather: gather kernel vs row gather + TMA GEMM vs the GEMM alone, and the
#            routed-expert block with gather=True vs False, in one process ($GATHER_ARGS)
#   parts    bench_layer_parts.py: the MoE block against its floor (GEMMs + shared expert) with the gather and with
#            the dispatch (--variants no_gather) at $PARTS_TOKENS tokens ($PARTS_EXTRA: more flags, e.g.
#            "--preset 397b-a17b")
#   prefill  the 40-layer 35b-a3b prefill, layer-wise, with $JAX_DWDP_MOE_GATHER=0, 1, 0 ($GATHER_RUNS; one process
#            each; the two dispatch runs bound the drift) at $SEQS tokens; $PREFILL_VAR names another variable to
#            set to those values instead (e.g. JAX_DWDP_GATHER_SWIGLU_CONFIG: the fused kernel's configuration)
# Logs and JSON under $OUT/gather.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}/gather; mkdir -p "$OUT"
STEPS=${STEPS:-"tests bench prefill"}
SEQS=${SEQS:-"16384"}
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
ls -la jax_dwdp/_lib
for step in $STEPS; do
  case $step in
    tests)
      echo "== tests"
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gather_gemm.py \
        tests/test_grouped_matmul.py ${MORE_TESTS:-} -k "${TEST_K:-gather or cutlass_matches_fp64 or poisoned}" \
        > "$OUT/tests.log" 2>&1
      echo "tests rc $?"; grep -E "^gather|^half tiles|^routed experts|passed|failed|error" "$OUT/tests.log" \
        | grep -v "sizes\[:8\]" | tail -${TEST_LINES:-30} ;;
    bench)
      echo "== bench"
      timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_grouped_matmul.py gather --out "$OUT/bench.json" \
        ${GATHER_ARGS:---presets 35b-a3b 122b-a10b 397b-a17b --tokens 4096 16384 32768 --routing uniform --iters 7} \
        2>&1 | filter | tee "$OUT/bench.log" | tail -30 ;;
    parts)
      echo "== parts"
      timeout ${PARTS_TIMEOUT:-200} python3 benchmarks/bench_layer_parts.py --tokens ${PARTS_TOKENS:-16384 32768} \
        --no-attention-alternatives --variants no_gather ${PARTS_EXTRA:-} --out "$OUT/parts.json" 2>&1 | filter > "$OUT/parts.log"
      echo "parts rc $?"; grep -E "^tokens|MoE block|gate_up|down grouped|shared expert|SwiGLU|dispatch rows, pallas|floor" \
        "$OUT/parts.log" ;;
    prefill)
      echo "== prefill"
      var=${PREFILL_VAR:-JAX_DWDP_MOE_GATHER}
      echo "runs: $var = ${GATHER_RUNS:-0 1 0}"
      printf '%-8s %-6s %9s %11s\n' value seq "compile s" "prefill ms"
      i=0
      for g in ${GATHER_RUNS:-0 1 0}; do
        log="$OUT/prefill_$i.log"
        env "$var=$g" XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${RUN_TIMEOUT:-150} python3 \
          benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens $SEQS --layerwise --iters 5 \
          --out "$OUT/prefill_$i.json" > "$log" 2>&1
        rc=$?
        for s in $SEQS; do
          line=$(grep -E "^ +$s +[0-9.]+ +[0-9.]+ " "$log" | tail -1)
          if [ $rc -ne 0 ] || [ -z "$line" ]; then
            printf '%-8s %-6s failed (rc %s): %s\n' "$g" "$s" "$rc" "$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
          else
            read -r _ compile ms _ <<<"$line"; printf '%-8s %-6s %9s %11s\n' "$g" "$s" "$compile" "$ms"
          fi
        done
        i=$((i + 1))
      done ;;
  esac
done
source benchmarks/gpu/_bundle_out.sh
bundle_out "$OUT"  # past 8 files, one $OUT/logs.tgz (the device tool returns at most 8)
