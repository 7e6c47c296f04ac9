#!/usr/bin/env bash
# Two GPUs (H200s, or H100s):
#   1. issue 15's pipeline bar (BAR=1, first): the 40-layer 35b-a3b pipeline over the two GPUs vs one GPU at 4 and 8
#      microbatches of one 8K sequence, layer-wise then scanned stages, each row also timing the stages from one host
#      thread. $BAR_LAYERS defaults to 40 on GPUs of more than 100 GB (H200s), else 32: the one-GPU baseline is freed
#      before the stages are built, but 40 layers (~66 GB of weights) on one 80-GB H100 leave too little for the
#      programs;
#   2. pipeline 2 vs one GPU on 8 layers (bubble per stage);
#   3. DWDP over XLA vs independent ranks vs replicated.
# Each command's limit is cut to what is left of $DEADLINE seconds (default 570; _limits.sh), past 8 files the logs
# come back as one $OUT/logs.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m | head -3 | tee -a "$OUT/gpu.txt"
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
source benchmarks/gpu/_limits.sh
BAR_LAYERS=${BAR_LAYERS:-$(by_memory 40 32)}
if [ "${BAR:-1}" = 1 ]; then
  for scan in "" "--scan"; do
    time_for "pipeline bar ${scan:-layer-wise}" || continue
    timeout $(limit ${BAR_TIMEOUT:-250}) python3 benchmarks/bench_pipeline.py --preset 35b-a3b --num-layers $BAR_LAYERS \
      --seq-len 8192 --microbatches 4 8 --iters 3 $scan --out "$OUT/pipeline${BAR_LAYERS}${scan:+_scan}.json" 2>&1 | filter \
      | tee "$OUT/pipeline${BAR_LAYERS}${scan:+_scan}.log"
  done
fi
time_for "pipeline, 8 layers" && timeout $(limit ${PIPE_TIMEOUT:-150}) python3 benchmarks/bench_pipeline.py \
  --preset 35b-a3b --num-layers 8 --seq-len 4096 --microbatches 1 2 4 8 --iters 2 \
  --out "$OUT/pipeline_35b_a3b_8layers.json" 2>&1 | filter | tee "$OUT/pipeline.log"
time_for "dwdp ranks" && timeout $(limit ${DWDP_TIMEOUT:-150}) python3 benchmarks/bench_dwdp.py ranks --preset 35b-a3b \
  --num-layers 2 --seq-len 16384 --iters 3 --out "$OUT/dwdp_xla_35b_a3b_2layers.json" 2>&1 | filter | tee "$OUT/dwdp.log"
source benchmarks/gpu/_bundle_out.sh
bundle_out "$OUT"  # past 8 files, one $OUT/logs.tgz (the device tool returns at most 8)
