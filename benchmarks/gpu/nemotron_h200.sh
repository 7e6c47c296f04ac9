#!/usr/bin/env bash
# One H200: the full-depth Nemotron-H prefill (nemotron-h:nano-30b-a3b, 52 layers, random bf16 weights, one sequence)
# in jax_dwdp (bench_prefill.py, layer-wise as the 40-layer Qwen3.5 runs; MFU against 781 TFLOP/s and against the
# dense matmul rate measured in the same process, --dense-rate) and then in transformers
# (bench_transformers.py: SDPA, grouped_mm experts, mamba_ssm's Triton chunked scan when .whl/ carries its wheel) in
# a process of its own on the same lengths, then both side by side with the ratio (gpu/prefill_ratio.py). Each
# process holds the 63.2 GB of weights (31.6B bf16) alone: together they would not fit the card.
# Logs and JSON under $OUT. Knobs: SEQS (lengths, default "4096 16384 32768"), PRESET, NUM_LAYERS (first N layers
# only; default all), ITERS (jax_dwdp's timed calls, 5), HF_ITERS (transformers', 3), HF_MAMBA (auto: mamba_ssm's
# kernels where they import; torch: transformers' PyTorch forms), PREFILL / HF (0 skips that side), PREFILL_TIMEOUT,
# HF_TIMEOUT, DEADLINE (570 s for the whole script, _limits.sh). If transformers fails with mamba_ssm's kernels
# before any length finished, it runs once more with its PyTorch forms (the row says which path ran).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu/_limits.sh
source benchmarks/gpu/_bundle_out.sh
SEQS=${SEQS:-$(by_memory "4096 16384 32768" "4096 16384")}  # 63 GB of weights: 32K's activations fit an H200 only
PRESET=${PRESET:-nemotron-h:nano-30b-a3b}
HF_MAMBA=${HF_MAMBA:-auto}
SITE=${SITE:-/tmp/site}  # where .whl/*.whl are installed, for transformers only
layers=${NUM_LAYERS:+--num-layers $NUM_LAYERS}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl > "$OUT/pip.log" 2>&1 \
    || echo "installing .whl/*.whl failed (pip.log): transformers runs with what the image has"
else
  echo "no .whl/: transformers runs with what the image has (no mamba_ssm: its PyTorch Mamba-2 forms)"
fi

if [ "${PREFILL:-1}" = 1 ] && time_for "jax_dwdp prefill"; then
  echo "== jax_dwdp: $PRESET ${NUM_LAYERS:+($NUM_LAYERS layers) }at $SEQS tokens, layer-wise"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "$(limit ${PREFILL_TIMEOUT:-270})" python3 benchmarks/bench_prefill.py \
    --preset "$PRESET" $layers --seq-lens $SEQS --layerwise --iters "${ITERS:-5}" --dense-rate 400 --out "$OUT/prefill.json" 2>&1 \
    | quiet | tee "$OUT/prefill.log"
fi

hf() {  # hf MAMBA_KERNELS: transformers' prefill of the same lengths into $OUT/transformers.json; its exit status
  echo "== transformers: $PRESET at $SEQS tokens, --mamba-kernels $1"
  PYTHONPATH=$PWD:$SITE PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    timeout "$(limit ${HF_TIMEOUT:-400})" python3 benchmarks/bench_transformers.py --preset "$PRESET" $layers \
    --seq-lens $SEQS --iters "${HF_ITERS:-3}" --mamba-kernels "$1" --out "$OUT/transformers.json" 2>&1 \
    | quiet | tee "$OUT/transformers_$1.log"
  return "${PIPESTATUS[0]}"
}
if [ "${HF:-1}" = 1 ] && time_for "transformers prefill"; then
  hf "$HF_MAMBA"; rc=$?
  # A failure (not the time limit, 124) before any length finished: mamba_ssm's kernels did not run here.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$HF_MAMBA" = auto ] \
     && ! grep -q '"prefill_ms"' "$OUT/transformers.json" 2>/dev/null \
     && time_for "transformers with its PyTorch Mamba-2 forms"; then
    echo "== transformers failed (exit $rc, transformers_auto.log): once more with its PyTorch Mamba-2 forms"
    hf torch
  fi
fi

echo "== $PRESET, $(head -1 "$OUT/gpu.txt")"
python3 benchmarks/gpu/prefill_ratio.py "$OUT/prefill.json" "$OUT/transformers.json" | tee "$OUT/ratio.txt"
bundle_out "$OUT"  # past 8 files, one $OUT/logs.tgz (the device tool returns at most 8)
