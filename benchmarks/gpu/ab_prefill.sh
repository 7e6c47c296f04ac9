#!/usr/bin/env bash
# Side-by-side 40-layer 35b-a3b (PRESET) prefill on one GPU: variants run in turn, one process each, ROUNDS times,
# so machine drift falls on all of them alike. A variant is "NAME:TREE:ENV" with TREE a directory holding a jax_dwdp package
# and benchmarks/ (. for the working tree, or a copy of an earlier commit made here with
#   mkdir _before && git archive <commit> jax_dwdp benchmarks tests | tar -x -C _before
#   cp jax_dwdp/_lib/*.so _before/jax_dwdp/_lib/
# ) and ENV comma-separated VAR=value words for that variant. Knobs: VARIANTS (space-separated), ROUNDS (2), SEQ
# (16384), ITERS (10), PRESET (35b-a3b), TRACE (variant names: their last round also traced, summary in
# $OUT/trace_<name>.txt). More than 8 files under $OUT go back as $OUT/logs.tgz (the device tool returns 8).
# Each row of $OUT/ab.tsv: variant, round, prefill ms (median of ITERS), host ms, compile s.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/_limits.sh"
ROOT=$PWD
: > "$OUT/ab.tsv"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for variant in ${VARIANTS:-now:.:}; do
    IFS=: read -r name tree envs <<< "$variant"
    time_for "$name round $round" || break 2
    trace=()
    if [[ " ${TRACE:-} " == *" $name "* ]] && [ "$round" = "${ROUNDS:-2}" ]; then trace=(--trace "/tmp/trace_$name"); fi
    (cd "$ROOT/$tree" && env ${envs//,/ } PYTHONPATH="$ROOT/$tree" timeout "$(limit 200)" python3 \
      benchmarks/bench_prefill.py --preset "${PRESET:-35b-a3b}" --seq-lens "${SEQ:-16384}" --layerwise --iters "${ITERS:-10}" \
      "${trace[@]}" --out "$OUT/ab_${name}_$round.json") > "$OUT/ab_${name}_$round.log" 2>&1
    python3 - "$OUT/ab_${name}_$round.json" "$name" "$round" >> "$OUT/ab.tsv" <<'EOF' || echo "$name round $round: failed (see ab_${name}_$round.log)"
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
print(f"{sys.argv[2]}\t{sys.argv[3]}\t{row['prefill_ms']}\t{row['host_ms']}\t{row['compile_s']}\t"
      f"{min(row['times_ms'])}")
EOF
    if [ ${#trace[@]} -gt 0 ]; then grep -A70 "^device events" "$OUT/ab_${name}_$round.log" > "$OUT/trace_$name.txt"; fi
  done
done
echo "variant round prefill_ms host_ms compile_s min_ms"
cat "$OUT/ab.tsv"
python3 - "$OUT/ab.tsv" <<'EOF'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, _, ms, *_ = line.split("\t")
    rows[name].append(float(ms))
base = None
for name, ms in rows.items():
    med = statistics.median(ms)
    base = base or med
    print(f"{name}: median of rounds {med:.2f} ms ({', '.join(f'{m:.2f}' for m in ms)}), {med / base:.4f}x the first")
EOF
source "$(dirname "$0")/_bundle_out.sh"
bundle_out "$OUT"
