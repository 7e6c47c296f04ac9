#!/usr/bin/env bash
# One H200: the prefill attention core, cuDNN against Pallas Mosaic GPU's attention_mgpu (issue 15's attention item).
# Run from the repository root with the FFI library in jax_dwdp/_lib (carried). Steps ($STEPS, default
# "bench tests prefill"):
#   bench    bench_attention.py: both cores at $ATTN_TOKENS (float64 reference rows, the diff to cuDNN, TF/s)
#   tests    the attention GPU tests (tests/test_gpu.py -k "mgpu or cudnn")
#   prefill  the 40-layer 35b-a3b prefill, layer-wise, with $JAX_DWDP_ATTENTION = each of $ATTN_RUNS (one process
#            each; default "cudnn mgpu cudnn": the two cuDNN runs bound the drift) at $SEQS tokens
#   probe    probe_layer_kernels.py at $PROBE_TOKENS: both layers' kernels by name (today's defaults)
# Logs and JSON under $OUT/attention.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}/attention; mkdir -p "$OUT"
STEPS=${STEPS:-"bench tests prefill"}
SEQS=${SEQS:-"16384"}
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    bench)
      echo "== bench"
      timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_attention.py --tokens ${ATTN_TOKENS:-4096 16384 32768} \
        --out "$OUT/bench.json" 2>&1 | filter > "$OUT/bench.log"
      echo "bench rc $?"; grep -v "^tokens\|^NVIDIA" "$OUT/bench.log" | cut -c1-160 | tail -40 ;;
    tests)
      echo "== tests"
      timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        -k "${TEST_K:-mgpu or cudnn}" > "$OUT/tests.log" 2>&1
      echo "tests rc $?"; grep -E "attention|passed|failed|Error" "$OUT/tests.log" | tail -12 ;;
    prefill)
      echo "== prefill"
      printf '%-8s %-6s %9s %11s\n' core seq "compile s" "prefill ms"
      i=0
      for a in ${ATTN_RUNS:-cudnn mgpu cudnn}; do
        log="$OUT/prefill_$i.log"
        JAX_DWDP_ATTENTION=$a XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${RUN_TIMEOUT:-100} python3 \
          benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens $SEQS --layerwise --iters 5 \
          --out "$OUT/prefill_$i.json" > "$log" 2>&1
        rc=$?
        for s in $SEQS; do
          line=$(grep -E "^ +$s +[0-9.]+ +[0-9.]+ " "$log" | tail -1)
          if [ $rc -ne 0 ] || [ -z "$line" ]; then
            printf '%-8s %-6s failed (rc %s): %s\n' "$a" "$s" "$rc" "$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
          else
            read -r _ compile ms _ <<<"$line"; printf '%-8s %-6s %9s %11s\n' "$a" "$s" "$compile" "$ms"
          fi
        done
        i=$((i + 1))
      done ;;
    probe)
      echo "== probe"
      timeout ${PROBE_TIMEOUT:-100} python3 benchmarks/probe_layer_kernels.py --tokens ${PROBE_TOKENS:-16384} \
        --out-dir "$OUT/probe" 2>&1 | filter > "$OUT/probe.log"
      echo "probe rc $?"; grep -A30 "tokens:" "$OUT/probe.log" | cut -c1-150 | head -64 ;;
  esac
done
