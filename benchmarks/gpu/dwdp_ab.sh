#!/usr/bin/env bash
# Two H200s, from the repository root: (ab) the one-stage DWDP benchmark of an old tree (default a4f90c6, the code
# before the stage-runner redesign) and of this tree on the same machine, FFI and replicated only, one table old vs
# new; (probes) where this tree's FFI time over replicated goes (bench_dwdp.py stage's probe variants). Logs and
# JSON under $OUT.
#
#   1. Here, where git is (once; build/ is git-ignored):
#        bash benchmarks/gpu/dwdp_ab.sh export          # build/old_dwdp <- `git archive $OLD_REV` (default a4f90c6)
#   2. On the GPU machine, the device tool's carry = ["build/old_dwdp"]:
#        STEPS=ab bash benchmarks/gpu/dwdp_ab.sh        # old vs new (~4-5 min)
#        STEPS=probes bash benchmarks/gpu/dwdp_ab.sh    # this tree's probes (~4 min; needs no carry)
#      (STEPS="ab probes", the default, does both in one call: may pass a 10-minute limit.)
#
# ab: each tree builds its own libjax_dwdp_ffi.so (target jax_dwdp_ffi in both CMakeLists; the old tree's source is
#   ffi/dwdp_store.cc, the new one's ffi/dwdp_store/) into its own jax_dwdp/_lib, and runs with PYTHONPATH and
#   JAX_DWDP_FFI_LIB pointing at its own tree only (the jax_dwdp imported is printed):
#     old: build/old_dwdp/benchmarks/bench_dwdp.py --preset 35b-a3b --num-layers 16 --seq-lens 16384 --iters 3
#          --variants ffi replicated                     (the old script has --variants, no subcommands)
#     new: benchmarks/bench_dwdp.py stage ... the same flags
#   both with JAX_DWDP_GDN=xla (the old tree has only the XLA gated delta rule: no Pallas GDN, no such variable)
#   and JAX_DWDP_GROUPED_MATMUL=$GMM (default mosaic: neither build makes the CUTLASS library, so both would take
#   Mosaic anyway; pinned so a stray libjax_dwdp_gmm.so cannot make the trees differ). ORDER (default "old new")
#   is the run order; "old new new old" repeats each (ABBA: a drift over the run cancels in the medians). The
#   GPUs' SM clock, temperature and power are printed before each run.
#   Reading the table: per tree the medians of ffi and replicated ms, then new/old for each. Recorded in separate
#   runs (2x H200, 2026-11-30: benchmarks/RESULTS.md, "DWDP vs replicated weights vs DEP"): old 293.67 / 290.43 ms
#   (a/c 1.011), new 292.05 / 277.63 (1.052). replicated
#   new/old ~0.96 with ffi new/old ~1.0 on one machine: the regression is real and on the FFI side of the new
#   tree; both ~1.0: the trees are the same and the recorded gap was the machine (clocks); both ~0.96: the
#   new tree is faster everywhere and a/c equal, the old run's FFI number was the odd one.
# probes: bench_dwdp.py stage --variants ffi ffi-nowait ffi-unused ffi-depth2 replicated at SEQ tokens/rank with
#   this tree's default GDN (Pallas; PROBE_GDN=xla for the A/B's setting). ffi-nowait and ffi-unused are timing-only
#   (wrong results on purpose). Its second table: a/c, nowait/c, unused/c, depth2/c, and per layer the stall
#   (a - nowait) and the contention (unused - c); see the module doc of benchmarks/bench_dwdp.py.
#
# Env: STEPS ("ab probes"), OLD_REV (export only, a4f90c6), ORDER ("old new"), SEQ (16384), LAYERS (16), ITERS (3),
# GMM (mosaic), PRESET (35b-a3b), AB_VARIANTS ("ffi replicated"), PROBE_GDN (unset: the default),
# PROBE_VARIANTS ("ffi ffi-nowait ffi-unused ffi-depth2 replicated"), AB_TIMEOUT (s per run, 240), PROBE_TIMEOUT
# (s, 420).

OLD=build/old_dwdp
if [ "${1:-}" = export ]; then  # here: the old tree, without its git history, into build/old_dwdp
  set -e
  rev=${OLD_REV:-a4f90c6}
  git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "no commit $rev here"; exit 1; }
  rm -rf "$OLD" && mkdir -p "$OLD"
  git archive "$rev" | tar -x -C "$OLD"
  git rev-parse "$rev" > "$OLD/REVISION"
  echo "$OLD: $(cat "$OLD/REVISION"), $(du -sh "$OLD" | cut -f1); pass carry [\"$OLD\"] to the GPU call"
  exit 0
fi

STEPS=${STEPS:-ab probes}
want() { [[ " $STEPS " == *" $1 "* ]]; }
if want ab && [ ! -f "$OLD/ffi/CMakeLists.txt" ]; then
  echo "no $OLD: run 'bash benchmarks/gpu/dwdp_ab.sh export' where git is and carry [\"$OLD\"]"; exit 1
fi
source benchmarks/gpu/_dwdp_prologue.sh  # env, $OUT, filter, gpu.txt, this tree's library (exits if it fails)
SEQ=${SEQ:-16384} LAYERS=${LAYERS:-16} ITERS=${ITERS:-3} GMM=${GMM:-mosaic}
PRESET=${PRESET:-35b-a3b}
clocks() {  # every GPU's SM and memory clock, temperature, power, on one line
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | paste -sd';'
}

if want ab; then
  echo "== build the old tree ($(cat $OLD/REVISION 2>/dev/null || echo '?'))"; t0=$(date +%s)
  rm -f "$OUT"/ab_*_*.json "$OUT"/ab_*_*.log  # (the summary reads every ab_*.json under $OUT)
  rm -f $OLD/jax_dwdp/_lib/libjax_dwdp_ffi.so
  cmake -S $OLD/ffi -B /tmp/ffib_old -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
    -DJAX_DWDP_LIB_DIR="$PWD/$OLD/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build_old.log" 2>&1 \
    && cmake --build /tmp/ffib_old -j 16 --target jax_dwdp_ffi >> "$OUT/build_old.log" 2>&1 \
    || { tail -30 "$OUT/build_old.log"; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s"; ls -la $OLD/jax_dwdp/_lib
  i=0
  for tree in ${ORDER:-old new}; do
    i=$((i + 1))
    case $tree in
      old) root=$PWD/$OLD; sub= ;;
      new) root=$PWD; sub=stage ;;
      *) echo "ORDER: old or new, not $tree"; exit 1 ;;
    esac
    echo "== run $i: $tree tree (GPU sm MHz, mem MHz, C, W: $(clocks))"
    PYTHONPATH=$root python3 -P -c "import jax_dwdp; print('jax_dwdp from', jax_dwdp.__file__)"
    PYTHONPATH=$root JAX_DWDP_FFI_LIB=$root/jax_dwdp/_lib/libjax_dwdp_ffi.so JAX_DWDP_GDN=xla \
      JAX_DWDP_GROUPED_MATMUL=$GMM XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${AB_TIMEOUT:-240} \
      python3 $root/benchmarks/bench_dwdp.py $sub --preset $PRESET --num-layers $LAYERS --seq-lens $SEQ \
      --iters $ITERS --variants ${AB_VARIANTS:-ffi replicated} --out "$OUT/ab_${i}_$tree.json" 2>&1 | filter \
      | grep -v "^|" | tee "$OUT/ab_${i}_$tree.log"
    echo "(rc ${PIPESTATUS[0]}; 124 = timed out)"
  done
  echo "== old vs new ($LAYERS layers, $SEQ tokens/rank, GDN xla, grouped matmul $GMM)"
  python3 - "$OUT" <<'EOF'
import glob, json, re, statistics, sys
runs = []
for path in sorted(glob.glob(f"{sys.argv[1]}/ab_*_*.json"), key=lambda p: int(re.search(r"ab_(\d+)_", p)[1])):
    (row,) = json.load(open(path))["rows"]
    runs.append((re.search(r"ab_(\d+)_(\w+)\.json", path).groups(), row))
keys = ("ffi_ms", "replicated_ms", "ffi_vs_replicated", "ffi_copy_ms_per_layer", "ffi_copy_ms_per_layer_idle",
        "moe_ms_per_layer", "layer_ms_replicated", "ffi_copy_hidden_fraction")
print("| run | tree | (a) ffi ms | (c) replicated ms | a/c | copy ms/layer under compute | copy ms/layer idle "
      "| MoE ms/layer | layer ms (c) | copy hidden |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for (i, tree), row in runs:
    print(f"| {i} | {tree} | " + " | ".join(str(row.get(k)) for k in keys) + " |")
def median(tree, key):
    values = [r[key] for (_, t), r in runs if t == tree and key in r]
    return statistics.median(values) if values else None

med = {t: {k: median(t, k) for k in ("ffi_ms", "replicated_ms")} for t in ("old", "new")}
for t, m in med.items():
    a, c = m["ffi_ms"], m["replicated_ms"]
    print(f"{t}: median ffi {a} ms, replicated {c} ms, a/c {round(a / c, 3) if a and c else None}")
for k in ("ffi_ms", "replicated_ms"):
    old, new = med["old"][k], med["new"][k]
    print(f"new/old {k[:-3]}: {round(new / old, 3) if old and new else None}")
print("recorded on other days: old 293.67 / 290.43 (a/c 1.011), new 292.05 / 277.63 (a/c 1.052)")
EOF
fi

if want probes; then
  echo "== probes: this tree, ${PROBE_GDN:-default} GDN (GPU sm MHz, mem MHz, C, W: $(clocks))"
  env ${PROBE_GDN:+JAX_DWDP_GDN=$PROBE_GDN} JAX_DWDP_GROUPED_MATMUL=$GMM XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout ${PROBE_TIMEOUT:-420} python3 benchmarks/bench_dwdp.py stage --preset $PRESET --num-layers $LAYERS \
    --seq-lens $SEQ --iters $ITERS --variants ${PROBE_VARIANTS:-ffi ffi-nowait ffi-unused ffi-depth2 replicated} \
    --out "$OUT/probes.json" 2>&1 | filter | tee "$OUT/probes.log"
  echo "(rc ${PIPESTATUS[0]}; 124 = timed out: the per-variant lines above are what finished)"
fi
