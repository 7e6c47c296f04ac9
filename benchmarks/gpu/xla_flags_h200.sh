#!/usr/bin/env bash
# One H200: the 40-layer 35b-a3b prefill (layer-wise, today's defaults) under XLA compiler flags, one process per
# setting, the defaults first and last (drift between the two says how far the others can be trusted). Prints one
# line per setting: compile s, prefill ms, speed-up over the first default run (> 1: faster); logs and JSON under $OUT/xla_flags.
# Knobs: SEQ (tokens, default 16384), FLAGS_LIST (newline-separated XLA_FLAGS values; "defaults" = none),
# RUN_TIMEOUT (seconds per setting).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}/xla_flags; mkdir -p "$OUT"
SEQ=${SEQ:-16384}
FLAGS_LIST=${FLAGS_LIST-"defaults
--xla_gpu_enable_triton_gemm=false
--xla_gpu_enable_cublaslt=true
--xla_gpu_enable_command_buffer=
--xla_gpu_cudnn_gemm_fusion_level=2
--xla_gpu_exhaustive_tiling_search=true
--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true
defaults"}
base=""
i=0
printf '%-64s %9s %11s %9s\n' "XLA_FLAGS" "compile s" "prefill ms" "speed-up"
while IFS= read -r flags || [ -n "$flags" ]; do
  [ -z "$flags" ] && continue
  [ "$flags" = defaults ] && flags=""
  log="$OUT/run_$i.log"
  XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${RUN_TIMEOUT:-100} python3 benchmarks/bench_prefill.py \
    --preset 35b-a3b --seq-lens "$SEQ" --layerwise --iters 5 --out "$OUT/run_$i.json" > "$log" 2>&1
  rc=$?
  line=$(grep -E "^ +$SEQ +[0-9.]+ +[0-9.]+ " "$log" | tail -1)
  if [ $rc -ne 0 ] || [ -z "$line" ]; then
    printf '%-64s %s\n' "${flags:-(defaults)}" "failed (rc $rc): $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
  else
    read -r _ compile ms _ <<<"$line"
    [ -z "$base" ] && base=$ms
    printf '%-64s %9s %11s %9s\n' "${flags:-(defaults)}" "$compile" "$ms" "$(python3 -c "print(f'{$base / $ms:.3f}')")"
  fi
  i=$((i + 1))
done <<<"$FLAGS_LIST"
