"""The benchmark results the notebooks plot: read from benchmarks/results/ (the committed GPU runs) or from a fresh
run's JSON, and drawn with matplotlib at a small size (the executed notebooks stay small).

Each `*_rows` / `*_runs` function turns one JSON layout into plain rows; each `plot_*` function draws them and
returns the figure. Fresh runs are subprocesses (`fresh_run`) of the benchmark scripts of benchmarks/, so a notebook
never holds a GPU while a benchmark needs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIG_DPI = 72  # small PNGs: a notebook's outputs stay in the tens of KB


def load(name: str | Path) -> dict:
    """A results file by name (under benchmarks/results/) or path."""
    path = Path(name)
    return json.loads((path if path.is_absolute() else RESULTS / path).read_text())


def tokens_axis(ax, values, label: str = "tokens") -> None:
    """A log2 x axis with ticks at the measured token counts, labelled 4K, 16K, ..."""
    values = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [f"{v // 1024}K" if v % 1024 == 0 else str(v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel(label)


def plain_log_y(ax) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def figure(ncols: int = 1, width: float = 9.0, height: float = 3.2):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=FIG_DPI, squeeze=False)
    return fig, list(axes[0])


# ---- fresh runs (GPU machines) -----------------------------------------------------------------------------------


def gpu_count() -> int:
    """NVIDIA GPUs on this machine (nvidia-smi -L), without starting JAX; 0 when there is no driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0


def fresh_runs_wanted(gpus_needed: int) -> bool:
    """True on a machine with enough GPUs, unless JAX_DWDP_FRESH_RUNS=0."""
    return os.environ.get("JAX_DWDP_FRESH_RUNS", "1") != "0" and gpu_count() >= gpus_needed


def fresh_run(script_args: list[str], out: Path, timeout_s: int = 900) -> dict | None:
    """Runs `python SCRIPT ARGS --out OUT` from the repository root; the JSON it wrote, or None (with the reason
    printed) when it failed."""
    cmd = [sys.executable, *script_args, "--out", str(out)]
    print("fresh run:", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"fresh run stopped after {timeout_s} s")
        return None
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        print(f"fresh run failed (exit {done.returncode}): " + " | ".join(tail))
        return None
    return json.loads(out.read_text())


# ---- 1. layer time by part and sequence length -------------------------------------------------------------------

LAYER_PARTS = {"linear": ("gdn_mixer_ms", "linear_layer_ms"), "full": ("attention_mixer_ms", "full_layer_ms")}


def plot_layer_parts(rows: list[dict], title: str):
    """Per sequence length, a linear-attention and a full-attention layer: mixer and MoE block stacked (each timed
    alone), the whole layer as a black bar-wide tick (timed on its own, so the two need not add up exactly)."""
    fig, (ax,) = figure(width=8.0)
    width = 0.38
    for i, row in enumerate(rows):
        for j, (kind, (mixer, whole)) in enumerate(LAYER_PARTS.items()):
            x = i + (j - 0.5) * width * 1.05
            color = "tab:blue" if kind == "linear" else "tab:orange"
            ax.bar(x, row[mixer], width, color=color, label=f"{kind}-attention mixer" if i == 0 else None)
            if kind == "linear" and "gdn_core_ms" in row:
                ax.bar(x, row["gdn_core_ms"], width * 0.5, color="navy", label="of it: GDN core" if i == 0 else None)
            ax.bar(x, row["moe_block_ms"], width, bottom=row[mixer], color="tab:green",
                   label="MoE block" if i == 0 and j == 0 else None)
            ax.hlines(row[whole], x - width / 2, x + width / 2, colors="black", linewidth=2,
                      label="whole layer" if i == 0 and j == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['tokens'] // 1024}K tokens\nlinear | full" for r in rows])
    ax.set_ylabel("ms per layer")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


MIXER_PARTS = {  # bench_gdn.py --mixer keys -> what they time
    "mixer_ms": "whole mixer",
    "in_proj_qkv_ms": "in_proj_qkv (matmul)",
    "conv_silu_ms": "causal conv + SiLU",
    "gates_ms": "g / beta gate math",
    "core_ms": "core (Pallas)",
    "z_norm_out_proj_ms": "in_proj_z + gated norm + out_proj",
    "gated_norm_ms": "  of it: gated RMSNorm",
}


def plot_mixer_parts(mixer: dict, title: str):
    """The Gated DeltaNet mixer's parts (bench_gdn.py --mixer) as horizontal bars, the whole mixer on top."""
    parts = [(label, mixer[key]) for key, label in MIXER_PARTS.items() if key in mixer]
    fig, (ax,) = figure(width=7.0, height=2.6)
    names, values = zip(*parts)
    ax.barh(range(len(parts)), values, color=["black" if n == "whole mixer" else "tab:blue" for n in names])
    ax.set_yticks(range(len(parts)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


LAYER_PART_NAMES = {  # bench_layer_parts.py's part names -> the plot's keys
    "gdn_mixer_ms": "GDN mixer (with input norm)",
    "attention_mixer_ms": "attention mixer (with input norm)",
    "moe_block_ms": "MoE block",
    "linear_layer_ms": "linear-attention layer",
    "full_layer_ms": "full-attention layer",
    "gdn_core_ms": "GDN: core (gated delta rule)",
}


def layer_part_rows(result: dict) -> list[dict]:
    """bench_layer_parts.py's JSON (one row per token count and part) -> one row per token count with the plot's
    keys, for the parts it timed (the default variant of each, not the "(XLA routing)" / "(Pallas conv)" ones)."""
    rows = {}
    for r in result["rows"]:
        row = rows.setdefault(r["tokens"], {"tokens": r["tokens"]})
        for key, part in LAYER_PART_NAMES.items():
            if r["part"] == part and r.get("ms") is not None:
                row[key] = round(r["ms"], 3)
    return [rows[t] for t in sorted(rows)]


# ---- 2. DWDP: copy vs compute per layer, hidden fraction; 3. FFI vs XLA vs replicated (and DEP) ----------------

DWDP_RUNS = [  # (label: machine, date, code, configuration; file under benchmarks/results/), oldest first
    ("2x H200, 2026-11-30, before the stage runner (a4f90c6), XLA GDN",
     "dwdp_ffi_h200x2_4k_32k_2026-11-30_fourth.json"),
    ("2x H200, 2026-11-30, stage runner (ea0b9bd), XLA GDN", "dwdp_h200x2_2026-11-30_seventh_xla_gdn.json"),
    ("2x H200, 2026-11-30, stage runner (ea0b9bd), Pallas GDN", "dwdp_h200x2_2026-11-30_seventh_pallas_gdn.json"),
]


def dwdp_runs() -> list[tuple[str, list[dict]]]:
    """(label, rows of `bench_dwdp.py stage`) of the committed two-H200 runs, oldest first, each labelled by machine,
    date, code and configuration."""
    return [(label, load(name)["rows"]) for label, name in DWDP_RUNS]


def plot_dwdp_copy(runs: list[tuple[str, list[dict]]]):
    """Left: per layer, the compute (replicated weights: nothing copied), its MoE part, and the peer copy of the
    next layer's experts, under compute and on an idle GPU. Right: the fraction of the copy hidden under compute."""
    fig, (ax, ax2) = figure(ncols=2, width=10.0, height=3.6)
    markers = "osD^v"
    for (label, rows), marker in zip(runs, markers):
        x = [r["seq_len_per_rank"] for r in rows]
        style = dict(marker=marker, markersize=4)
        ax.plot(x, [r["layer_ms_replicated"] for r in rows], color="tab:blue", **style,
                label="layer (replicated)" if marker == "o" else None)
        ax.plot(x, [r["moe_ms_per_layer"] for r in rows], color="tab:green", **style,
                label="MoE of it" if marker == "o" else None)
        ax.plot(x, [r["ffi_copy_ms_per_layer"] for r in rows], color="tab:red", **style,
                label="copy under compute" if marker == "o" else None)
        ax.plot(x, [r["ffi_copy_ms_per_layer_idle"] for r in rows], color="tab:red", linestyle=":", **style,
                label="copy, idle GPU" if marker == "o" else None)
        ax2.plot(x, [r["ffi_copy_hidden_fraction"] for r in rows], marker=marker, label=label)
    every = [r["seq_len_per_rank"] for _, rows in runs for r in rows]
    for a in (ax, ax2):
        tokens_axis(a, every, "tokens per rank")
    ax.set_ylabel("ms per layer")
    plain_log_y(ax)
    ax.legend(fontsize=7, title="marker = run (right)", title_fontsize=7)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("copy hidden under compute")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def dep_points(results_dir: Path = RESULTS) -> list[dict]:
    """DEP measurements under results_dir as {label, tokens_per_rank, vs_replicated} (DEP time / replicated time):
    rows with `dep_ms` next to `replicated_ms` and a tokens-per-rank key, or `bench_stream.py` output (the balanced
    stream: every prompt --mean tokens; time ratio = replicated tokens/s / DEP tokens/s). Empty when none exist."""
    points = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            continue
        for r in rows:
            tokens = r.get("seq_len_per_rank", r.get("tokens_per_rank"))
            if "dep_ms" in r and "replicated_ms" in r and tokens:
                points.append(dict(label=path.stem, tokens_per_rank=tokens, vs_replicated=r["dep_ms"] / r["replicated_ms"]))
        by = {(r.get("scheme"), r.get("stream")): r for r in rows if "tokens_per_s_per_gpu" in r and "error" not in r}
        dep, rep = by.get(("dep", "balanced")), by.get(("replicated", "balanced"))
        mean = (data.get("args") or {}).get("mean")
        if dep and rep and mean:
            points.append(dict(label=f"{path.stem} (balanced stream)", tokens_per_rank=mean,
                               vs_replicated=rep["tokens_per_s_per_gpu"] / dep["tokens_per_s_per_gpu"]))
    return points


def plot_dwdp_vs_replicated(runs: list[tuple[str, list[dict]]], dep: list[dict]):
    """Prefill time relative to replicated weights (1 = as fast as holding every expert) against tokens per rank:
    DWDP over the CUDA VMM store (FFI) and over XLA all-gathers, each run; DEP where measured."""
    fig, (ax,) = figure(width=8.0, height=3.6)
    for (label, rows), marker in zip(runs, "osD^v"):
        x = [r["seq_len_per_rank"] for r in rows]
        ax.plot(x, [r["ffi_vs_replicated"] for r in rows], marker=marker, color="tab:red", label=f"FFI: {label}")
        ax.plot(x, [r["xla_vs_replicated"] for r in rows], marker=marker, color="tab:purple", linestyle="--",
                label=f"XLA: {label}")
    for p in dep:
        ax.plot([p["tokens_per_rank"]], [p["vs_replicated"]], marker="*", markersize=10, color="black", linestyle="",
                label=f"DEP: {p['label']}")
    ax.axhline(1.0, color="gray", linewidth=1, label="replicated weights")
    tokens_axis(ax, [r["seq_len_per_rank"] for _, rows in runs for r in rows] + [p["tokens_per_rank"] for p in dep],
                "tokens per rank")
    ax.set_ylabel("time / replicated")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


# ---- 4. the pipeline schedule ------------------------------------------------------------------------------------


def pipeline_schedule(stage_ms: list[float], microbatches: int) -> list[tuple[int, int, float, float]]:
    """(stage, microbatch, start, end) in ms: microbatch j runs on stage s once stage s - 1 has finished it and
    stage s has finished microbatch j - 1 (the order Pipeline.prefill enqueues them), each taking stage s's time."""
    end: dict[tuple[int, int], float] = {}
    bars = []
    for j in range(microbatches):
        for s, t in enumerate(stage_ms):
            start = max(end.get((s, j - 1), 0.0), end.get((s - 1, j), 0.0))
            end[s, j] = start + t
            bars.append((s, j, start, start + t))
    return bars


def plot_pipeline(rows: list[dict], title: str):
    """One timeline per measured microbatch count: stages x microbatches from each stage's measured time on one
    microbatch; the dashed line is the measured wall time of the whole pipelined prefill."""
    import matplotlib.pyplot as plt

    fig, axes = figure(ncols=len(rows), width=3.2 * len(rows), height=2.4)
    colors = plt.get_cmap("tab10")
    for ax, row in zip(axes, rows):
        bars = pipeline_schedule(row["stage_ms"], row["microbatches"])
        for s, j, start, stop in bars:
            ax.barh(s, stop - start, left=start, color=colors(j % 10), edgecolor="white")
            ax.text((start + stop) / 2, s, str(j), ha="center", va="center", fontsize=7, color="white")
        ax.axvline(row["pipeline_ms"], color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(row["stage_ms"])), [f"stage {s}" for s in range(len(row["stage_ms"]))], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms", fontsize=8)
        ax.set_title(f"{row['microbatches']} microbatches: {row['speedup']}x one GPU", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ---- 5. grouped GEMM vs torch ------------------------------------------------------------------------------------

GEMM_RUNS = [  # (file, models taken from it, the column that is the automatic config today)
    ("grouped_matmul_h200_2026-11-30_fourth_b.json", ("35b-a3b", "122b-a10b"), "cutlass"),
    ("grouped_matmul_h200_2026-11-30_fourth_a.json", ("397b-a17b",), "cutlass[coop_128x256x64_c1x1]"),
]


def gemm_rows(data: dict, models=None, column: str = "cutlass") -> list[dict]:
    """Rows of `bench_grouped_matmul.py calls` with jax_dwdp's time (`column`), torch._grouped_mm's and a dense
    matmul's of the same FLOPs, and speedup = torch / jax_dwdp."""
    out = []
    for r in data["rows"]:
        t = r["times_ms"]
        if (models is None or r["model"] in models) and column in t and "torch" in t:
            out.append(dict(model=r["model"], proj=r["proj"], tokens=r["tokens"], routing=r["routing"],
                            jax_ms=t[column], torch_ms=t["torch"], dense_ms=t.get("dense"),
                            speedup=t["torch"] / t[column]))
    return out


def committed_gemm_rows() -> list[dict]:
    return [row for name, models, column in GEMM_RUNS for row in gemm_rows(load(name), models, column)]


def plot_gemm(rows: list[dict], title: str):
    """torch._grouped_mm time / jax_dwdp's CUTLASS grouped GEMM time, per model, projection, tokens and routing."""
    models = sorted({r["model"] for r in rows}, key=lambda m: int(m.split("b")[0]))
    fig, axes = figure(ncols=len(models), width=3.3 * len(models), height=3.0)
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        cases = sorted({(r["proj"], r["tokens"]) for r in mine}, key=lambda c: (c[0] != "gate_up", -c[1]))
        for k, routing in enumerate(("uniform", "skewed")):
            vals = [next((r["speedup"] for r in mine if (r["proj"], r["tokens"]) == c and r["routing"] == routing),
                         0.0) for c in cases]
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(cases))], vals, 0.4, label=routing)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(cases)), [f"{p}\n{t // 1024}K" for p, t in cases], fontsize=7)
        ax.set_title(model, fontsize=9)
        ax.set_ylim(0, 1.5)
    axes[0].set_ylabel("torch time / jax_dwdp time")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ---- 6. the Gated DeltaNet kernel vs fla -------------------------------------------------------------------------


def plot_gdn(current: list[dict], before: list[dict], title: str):
    """Left: the core's time against tokens (35b-a3b heads, batch 1): today's Pallas kernels and fla in the same
    run, the first Pallas version and the XLA scan it replaced. Right: fla time / Pallas time per measured shape,
    labelled by heads, tokens, batch and the row's `note` where it has one."""
    fig, (ax, ax2) = figure(ncols=2, width=10.0, height=3.4)

    def line(rows, key, **style):
        runs = [r.get("run") for r in rows if r["heads"] == "16/32" and r.get("batch", 1) == 1]
        longest = max(set(runs), key=runs.count) if runs else None  # one run per line: the one with most lengths
        pts = sorted((r["tokens"], r[key]) for r in rows if r["heads"] == "16/32" and r.get("batch", 1) == 1
                     and r.get("run") == longest and r.get(key) is not None)
        if pts:
            ax.plot(*zip(*pts), **style)
        return [t for t, _ in pts]

    xs = line(current, "pallas_ms", marker="o", color="tab:blue", label="Pallas (today's default)")
    xs += line(current, "fla_ms", marker="s", color="tab:orange", label="fla 0.6 (same run)")
    xs += line(before, "pallas_ms", marker="o", color="tab:blue", linestyle=":", label="Pallas, first version")
    xs += line(before, "xla_ms", marker="^", color="gray", label="XLA chunked scan")
    tokens_axis(ax, xs)
    plain_log_y(ax)
    ax.set_ylabel("ms (16/32 heads, batch 1)")
    ax.legend(fontsize=7)
    compared = [r for r in current if r.get("fla_ms")]
    labels = [f"{r['heads']} {r['tokens'] // 1024}K" + (f" x{r['batch']}" if r.get("batch", 1) > 1 else "")
              + (f" ({r['note']})" if r.get("note") else "") for r in compared]
    ax2.bar(range(len(compared)), [r["fla_ms"] / r["pallas_ms"] for r in compared], color="tab:blue")
    ax2.axhline(1.0, color="black", linewidth=1)
    ax2.set_xticks(range(len(compared)), labels, rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("fla time / Pallas time")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ---- 7. the planner's predictions (notebook 05) ------------------------------------------------------------------

N_COLORS = {2: "tab:blue", 4: "tab:orange", 8: "tab:green", 72: "tab:red"}
EXCHANGE_STYLE = {"gather": "-", "routed": "--"}


def plot_planner_ratio(panels: list[tuple[str, dict]], xlabel: str, title: str, log_x: bool = True):
    """DWDP / DEP (tokens/s per GPU, predicted) per panel (one link each): one line per (ranks N, DEP exchange),
    `panels` = [(panel title, {(n, exchange): (xs, ratios)})]. Above 1: DWDP ahead."""
    fig, axes = figure(ncols=len(panels), width=5.0 * len(panels), height=3.4)
    for ax, (name, series) in zip(axes, panels):
        xs_all = []
        for (n, exchange), (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, color=N_COLORS.get(n, "black"), linestyle=EXCHANGE_STYLE[exchange], marker=".",
                    label=f"N={n}, DEP {exchange}")
            xs_all += list(xs)
        ax.axhline(1.0, color="gray", linewidth=1)
        if log_x:
            tokens_axis(ax, xs_all, xlabel)
        else:
            ax.set_xlabel(xlabel)
        plain_log_y(ax)
        ys_all = [y for _, ys in series.values() for y in ys]
        ax.set_yticks([t for t in (0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 8) if min(ys_all) * 0.9 <= t <= max(ys_all) * 1.1])
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("DWDP / DEP (predicted, log)")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_planner_memory(rows: list[dict], limits: dict, title: str):
    """Bytes per rank (predicted: weights, expert buffers, DEP's exchange buffers, the caches of one prompt) against
    ranks N, one panel per model; `rows`: {"model", "ranks", "scheme", "gib"}; `limits`: {label: GiB} drawn as
    horizontal lines (the GPUs' memory)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = figure(ncols=len(models), width=4.5 * len(models), height=3.2)
    styles = {"DWDP": ("tab:red", "o"), "DEP (gather)": ("tab:purple", "s"), "DEP (routed)": ("tab:purple", "^"),
              "replicated": ("gray", "D")}
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        for scheme, (color, marker) in styles.items():
            pts = sorted((r["ranks"], r["gib"]) for r in mine if r["scheme"] == scheme)
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=scheme)
        for label, gib in limits.items():
            ax.axhline(gib, color="black", linewidth=0.8, linestyle=":")
            ax.text(2, gib, label, fontsize=6, va="bottom")
        ax.set_xscale("log", base=2)
        ranks = sorted({r["ranks"] for r in mine})
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.minorticks_off()
        plain_log_y(ax)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("GiB per rank")
        ax.set_title(model, fontsize=8)
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_planner_checks(curve: dict, measured: list[dict], checks: list[dict], title: str):
    """Left: predicted DWDP / replicated against tokens per rank (two ranks, each measured run's own compute; `curve`:
    {label: (xs, ys, color)}) with the measured points on top (`measured`: {"tokens", "measured", "label", "marker",
    "color"}). Right: every expressible measurement, predicted against measured (the line: equal; the band: 15%),
    calibration rows hollow."""
    fig, (ax, ax2) = figure(ncols=2, width=10.0, height=3.6)
    for label, (xs, ys, color) in curve.items():
        ax.plot(xs, ys, linestyle="-", marker="", color=color, label=f"predicted: {label}")
    for m in measured:
        ax.plot([m["tokens"]], [m["measured"]], marker=m.get("marker", "o"), color=m.get("color", "black"),
                linestyle="", markersize=7, label=m["label"])
    ax.axhline(1.0, color="gray", linewidth=1)
    tokens_axis(ax, [m["tokens"] for m in measured], "tokens per rank")
    ax.set_ylabel("DWDP (FFI) / replicated")
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    ax.legend(keep.values(), keep.keys(), fontsize=6)
    groups = {"DWDP, two GPUs": "tab:red", "pipeline": "tab:blue", "link": "tab:green", "one GPU": "tab:orange"}
    lo = min(min(r["measured"], r["predicted"]) for r in checks)
    hi = max(max(r["measured"], r["predicted"]) for r in checks)
    ax2.plot([lo, hi], [lo, hi], color="gray", linewidth=1)
    ax2.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="gray", alpha=0.15)
    for group, color in groups.items():
        for role, face in (("calibration", "none"), ("validation", color), ("scaling", color)):
            pts = [(r["measured"], r["predicted"]) for r in checks if r["group"] == group and r["role"] == role]
            if pts:
                ax2.scatter(*zip(*pts), edgecolors=color, facecolors=face, s=18,
                            label=f"{group} ({role})")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("measured (ms, ratio or GiB/s)")
    ax2.set_ylabel("predicted")
    ax2.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
