"""A model of a prefill step for DWDP, DEP and replicated weights: when does DWDP beat DEP?

Nothing runs on a device. The inputs are measurements: a `GpuProfile` (JSON, written on one GPU by
benchmarks/profile_gpu.py, or built from benchmarks/RESULTS.md by benchmarks/profiles_from_results.py: the committed
ones are under jax_dwdp/profiles/), a `Link` between the GPUs (measured, or a spec-sheet value derated by what the
H200 pair measured; each says which) and a `RequestStream` of prompt lengths. `predict` gives, for one layout
(pipeline P x N ranks per stage):

- per layer and rank: the mixer and MoE time by the rank's tokens (the profile's fits: a + b*T + c*T^2 for full
  attention, linear in T for the Gated DeltaNet mixer and the MoE block; scaled by FLOPs when the model is not the
  profile's);
- DWDP: the bytes each rank copies per layer, (N-1)/N of the layer's experts, read in place (its own block never
  moves; when the blocks are not multiples of the 2 MiB VMM granularity the store copies its own block too, as
  `rank_memory` says), over the link; the copy slowed by the measured contention with compute and the compute slowed
  by the copy; how much of it hides under the previous layer (and this layer's mixer: the MoE waits for it); the
  first layer's exposed prefetch. The two CUDA streams are simulated layer by layer (`dwdp_timeline`);
- DEP (ranks in lockstep, as `Pipeline(..., experts="dep")` runs): the step padded to its longest prompt, the
  all-gather and all-to-all bytes per layer over the link, and each rank's wait for the slowest one;
- replicated weights: independent ranks, nothing moves (if the weights fit);
- memory per rank (`rank_memory`, plus DEP's exchange buffers and the caches of the longest prompt), tokens/s per
  GPU for the three over the request stream, and where DWDP / DEP crosses 1 in prompt length, imbalance and N.

What it leaves out (`LEAVES_OUT`, printed by `jax-dwdp plan`): host dispatch and Python time, the embedding and the
head, activations in the memory figure, the padding buckets' compile time, copy-engine contention between many
ranks pulling from one peer, collective algorithms beyond a per-GPU receive rate and a fixed latency, routing skew
(the experts' load is taken as even), and power or clock changes between the measured points.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION, REQUIRED_KEYS, ModelConfig, read_json_file
from jax_dwdp.options import MAX_SEED, OptionError
from jax_dwdp.parallel.expert_layout import ExpertLayout, expert_bytes_per_layer, rank_memory
from jax_dwdp.parallel.pipeline import plan_stages

PROFILE_FORMAT = "jax_dwdp.gpu_profile/1"
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
GIB = 2**30
KINDS = (LINEAR_ATTENTION, FULL_ATTENTION)
DEP_EXCHANGES = ("gather", "routed")
DEFAULT_STREAM = "16384"  # every prompt 16K tokens: the prefill length benchmarks/RESULTS.md measures most

LEAVES_OUT = (
    "host dispatch and Python time (the CUDA streams are taken as always fed)",
    "the embedding and the head (a few ms per prefill at most)",
    "activations in the memory per rank (weights, expert buffers, DEP's exchange buffers and the caches only)",
    "routing skew: the experts' load is taken as even",
    "many ranks pulling from one peer's copy engine at once (TensorRT-LLM measured it matters on NVL72)",
    "collective algorithms: a per-GPU receive rate and a fixed latency per collective",
    "power and clock changes between the measured points (the fits interpolate them)",
)


class PlannerError(OptionError):
    """Input the planner cannot use (a profile, link, or stream); the message names the file or value, and the
    parameter as options.OptionError does."""


# The model's layer times and FLOPs are Qwen3.5-MoE's (its Gated DeltaNet, attention and MoE layers, every layer with
# experts): a Nemotron-H model (Mamba-2 layers, MoE on every other layer) has no measured profile to scale from.
NOT_MODELLED = ("the performance model (--profile) is built from Qwen3.5-MoE's measured layers; Nemotron-H has no "
                "GPU profile yet (plan without --profile gives its layout and memory)")


# ---- measured values ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sourced:
    """A number and where it came from (a RESULTS.md row, a benchmark run, a spec sheet)."""

    value: float
    source: str

    @staticmethod
    def parse(raw, where: str) -> "Sourced":
        if not isinstance(raw, dict) or "value" not in raw or "source" not in raw:
            raise PlannerError(f"{where}: expected {{\"value\": number, \"source\": text}}")
        return Sourced(_positive(raw["value"], f"{where}.value"), str(raw["source"]))

    def to_json(self) -> dict:
        return {"value": self.value, "source": self.source}


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlannerError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _positive(value, where: str) -> float:
    value = _number(value, where)
    if value <= 0:
        raise PlannerError(f"{where}: must be > 0, got {value:g}")
    return value


@dataclasses.dataclass(frozen=True)
class Fit:
    """Milliseconds against tokens: a + b*T (+ c*T^2), least squares in relative error over measured points, every
    coefficient >= 0 (a term that would come out negative is dropped and the rest refitted)."""

    points: tuple[tuple[int, float, str], ...]  # (tokens, ms, source)
    degree: int
    coeffs: tuple[float, float, float]
    floor_ms: float = 0.0  # a time it never goes below (a scaled fit: reading the weights)

    @staticmethod
    def of(points, degree: int) -> "Fit":
        pts = tuple(sorted((int(t), float(ms), str(src)) for t, ms, src in points))
        if not pts:
            raise PlannerError("a fit needs at least one measured point")
        t = np.array([p[0] for p in pts], float)
        y = np.array([p[1] for p in pts], float)
        terms = [0, 1, 2][: degree + 1]
        best = None
        for mask in range(1, 2 ** len(terms)):  # every subset of the terms; the best non-negative one
            use = [k for i, k in enumerate(terms) if mask >> i & 1]
            if len(use) > len(pts):
                continue
            a = np.stack([t**k for k in use], axis=1) / y[:, None]
            c, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
            if np.any(c < 0):
                continue
            err = float(np.sum((a @ c - 1) ** 2))
            if best is None or err < best[0] - 1e-12 or (abs(err - best[0]) <= 1e-12 and len(use) < len(best[1])):
                best = (err, use, c)
        coeffs = [0.0, 0.0, 0.0]
        for k, v in zip(best[1], best[2]):
            coeffs[k] = float(v)
        return Fit(pts, degree, tuple(coeffs))

    def __call__(self, tokens) -> float:
        a, b, c = self.coeffs
        return max(self.floor_ms, a + b * tokens + c * tokens * tokens)

    def scaled(self, weights: float, linear: float, quadratic: float = 1.0) -> "Fit":
        """The curve of a layer with `weights` times the weight bytes, `linear` times the FLOPs per token and
        `quadratic` times attention's core: the per-token terms scaled, the constant kept (launches and fixed passes
        do not grow with the shapes), and never below the constant times `weights` (at few tokens a layer is as
        slow as reading its weights, which the profile's constant is for the MoE block: 1.6 GB of experts at
        35b-a3b, 0.58 ms on an H100)."""
        a, b, c = self.coeffs
        return dataclasses.replace(self, coeffs=(a, b * linear, c * quadratic), floor_ms=a * weights)


# ---- the link ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """The GPUs' interconnect as the model uses it: per GPU, the rate a copy engine receives a peer's block at
    (DWDP's copies) and the rate a collective receives at (DEP's all-gather / all-to-all), a fixed latency per
    collective, and whether the rates were measured or come from a spec sheet."""

    name: str
    peer_gib_s: float
    collective_gib_s: float
    latency_us: float
    kind: str  # "measured" or "spec sheet"
    source: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def parse(raw, where: str) -> "Link":
        if not isinstance(raw, dict):
            raise PlannerError(f"{where}: expected a JSON object")
        missing = [k for k in ("name", "peer_gib_s", "collective_gib_s", "latency_us", "kind", "source") if k not in raw]
        if missing:
            raise PlannerError(f"{where}: missing {', '.join(missing)}")
        if raw["kind"] not in ("measured", "spec sheet"):
            raise PlannerError(f"{where}.kind: \"measured\" or \"spec sheet\", got {raw['kind']!r}")
        latency = _number(raw["latency_us"], f"{where}.latency_us")
        if latency < 0:
            raise PlannerError(f"{where}.latency_us: must be >= 0, got {latency:g}")
        return Link(str(raw["name"]), _positive(raw["peer_gib_s"], f"{where}.peer_gib_s"),
                    _positive(raw["collective_gib_s"], f"{where}.collective_gib_s"), latency, raw["kind"],
                    str(raw["source"]))


# The H200 pair (NV18, 2026-11-30) measured a peer copy at 0.82 and an XLA all-gather at 0.57 of NVLink 4's 450 GB/s
# per direction (jax_dwdp/profiles/h200.json's link; tests/test_planner.py checks these against it). Spec-sheet
# links are derated by the same two ratios.
SPEC_PEER_EFFICIENCY = 0.816
SPEC_COLLECTIVE_EFFICIENCY = 0.570
ASSUMED_LATENCY_US = 20.0
_DERATE = (f"derated by what the H200 pair measured against NVLink 4's spec: peer copy x{SPEC_PEER_EFFICIENCY}, XLA "
           f"all-gather x{SPEC_COLLECTIVE_EFFICIENCY}; {ASSUMED_LATENCY_US:g} us per collective assumed (no DEP "
           "measurement yet)")


def spec_link(name: str, gb_s_per_direction: float, what: str) -> Link:
    rate = gb_s_per_direction * 1e9 / GIB
    return Link(name, round(rate * SPEC_PEER_EFFICIENCY, 1), round(rate * SPEC_COLLECTIVE_EFFICIENCY, 1),
                ASSUMED_LATENCY_US, "spec sheet", f"{what}: {gb_s_per_direction:g} GB/s per direction per GPU, {_DERATE}")


LINKS = {
    "nvlink4": spec_link("nvlink4", 450, "NVLink 4 (H100 / H200 SXM, NVSwitch or direct)"),
    "nvlink5": spec_link("nvlink5", 900, "NVLink 5 (B200 / GB200 NVL72)"),
}


def load_link(spec: str | None, profile: "GpuProfile") -> Link:
    """A link by name (`nvlink4`, `nvlink5`, `profile`: the profile's own) or from a JSON file (Link's fields)."""
    if spec is None or spec == "profile":
        if profile.link is None:
            raise PlannerError(f"the profile {profile.name!r} has no measured link: choose one ({', '.join(LINKS)} or a "
                               "JSON file)")
        return profile.link
    if spec in LINKS:
        return LINKS[spec]
    if not spec.endswith(".json") and not Path(spec).exists():
        raise PlannerError(f"{spec!r}: choose one of profile, {', '.join(LINKS)}, or a JSON file")
    return Link.parse(read_json_file(spec, PlannerError), spec)


# ---- the GPU profile ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Contention:
    """What a copy and the compute do to each other on one GPU, measured at a few token counts (a layer of the
    profile's model computing while the next layer's experts are copied): `copy_slowdown` = the copy's time under
    compute / on an idle GPU; `compute_loss` = ms of compute lost per ms the copy runs under it. Interpolated in
    log2(tokens), held constant past the ends."""

    tokens: tuple[int, ...]
    copy_slowdown: tuple[float, ...]
    compute_loss: tuple[float, ...]
    sources: tuple[str, ...]

    def at(self, tokens: float) -> tuple[float, float]:
        x = np.log2(np.maximum(np.asarray(self.tokens, float), 1.0))
        t = math.log2(max(float(tokens), 1.0))
        return float(np.interp(t, x, self.copy_slowdown)), float(np.interp(t, x, self.compute_loss))


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    """One GPU kind running one model's layers: what the planner predicts from. See docs/python_api.md for the JSON
    format; every number carries its source."""

    name: str
    device: str
    date: str
    code: str
    model: ModelConfig
    model_name: str
    dtype: str
    memory_gib: Sourced
    mixer: dict  # kind -> Fit
    moe: Fit
    dense_tflops: Sourced
    grouped_tflops: Sourced
    copy_gib_s: Sourced  # a device-to-device copy on one GPU, alone (bytes copied per second)
    contention: Contention
    link: Link | None
    notes: tuple[str, ...] = ()
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_json(raw, where: str = "profile") -> "GpuProfile":
        if not isinstance(raw, dict):
            raise PlannerError(f"{where}: expected a JSON object")
        if raw.get("format") != PROFILE_FORMAT:
            raise PlannerError(f"{where}: format {raw.get('format')!r}, expected {PROFILE_FORMAT!r}")
        missing = [k for k in ("name", "device", "date", "model", "layers", "gemm", "copy", "memory_gib")
                   if k not in raw]
        if missing:
            raise PlannerError(f"{where}: missing {', '.join(missing)}")
        model = raw["model"]
        if not isinstance(model, dict) or "config" not in model:
            raise PlannerError(f"{where}.model: expected {{\"name\", \"config\": {{shape keys}}}}")
        try:
            cfg = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
                                            **model["config"]}, source=f"{where}.model.config")
        except ValueError as e:
            raise PlannerError(str(e)) from None
        layers = raw["layers"]
        if not isinstance(layers, dict):
            raise PlannerError(f"{where}.layers: expected a JSON object")
        mixer = {}
        for kind, degree in ((LINEAR_ATTENTION, 1), (FULL_ATTENTION, 2)):
            mixer[kind] = Fit.of(_points(layers.get(f"{kind}_mixer_ms"), f"{where}.layers.{kind}_mixer_ms"), degree)
        moe = Fit.of(_points(layers.get("moe_ms"), f"{where}.layers.moe_ms"), 1)
        gemm, copy = raw["gemm"], raw["copy"]
        if not isinstance(gemm, dict) or not isinstance(copy, dict):
            raise PlannerError(f"{where}: gemm and copy must be JSON objects")
        under = copy.get("under_compute")
        if not isinstance(under, list) or not under:
            raise PlannerError(f"{where}.copy.under_compute: expected a list of measured points")
        rows = []
        for i, p in enumerate(under):
            w = f"{where}.copy.under_compute[{i}]"
            if not isinstance(p, dict):
                raise PlannerError(f"{w}: expected a JSON object")
            slow = _number(p.get("copy_slowdown"), f"{w}.copy_slowdown")
            loss = _number(p.get("compute_loss"), f"{w}.compute_loss")
            if slow < 1 or not 0 <= loss < 1:
                raise PlannerError(f"{w}: copy_slowdown must be >= 1 and compute_loss in [0, 1), got {slow:g}, "
                                   f"{loss:g}")
            rows.append((int(_positive(p.get("tokens"), f"{w}.tokens")), slow, loss, str(p.get("source", ""))))
        rows.sort()
        contention = Contention(*(tuple(c) for c in zip(*rows)))
        link = None if raw.get("link") is None else Link.parse(raw["link"], f"{where}.link")
        return GpuProfile(
            name=str(raw["name"]), device=str(raw["device"]), date=str(raw["date"]), code=str(raw.get("code", "")),
            model=cfg, model_name=str(model.get("name", "")), dtype=str(raw.get("dtype", "bfloat16")),
            memory_gib=Sourced.parse(raw["memory_gib"], f"{where}.memory_gib"), mixer=mixer, moe=moe,
            dense_tflops=Sourced.parse(gemm.get("dense_tflops"), f"{where}.gemm.dense_tflops"),
            grouped_tflops=Sourced.parse(gemm.get("grouped_tflops"), f"{where}.gemm.grouped_tflops"),
            copy_gib_s=Sourced.parse(copy.get("alone_gib_s"), f"{where}.copy.alone_gib_s"),
            contention=contention, link=link, notes=tuple(str(n) for n in raw.get("notes", [])), raw=raw)

    def summary(self) -> dict:
        return {"name": self.name, "device": self.device, "date": self.date, "code": self.code,
                "model": self.model_name, "link": None if self.link is None else self.link.name}


def _points(raw, where: str) -> list[tuple[int, float, str]]:
    if not isinstance(raw, list) or not raw:
        raise PlannerError(f"{where}: expected a list of {{\"tokens\", \"ms\", \"source\"}}")
    out = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise PlannerError(f"{where}[{i}]: expected a JSON object")
        out.append((int(_positive(p.get("tokens"), f"{where}[{i}].tokens")),
                    _positive(p.get("ms"), f"{where}[{i}].ms"), str(p.get("source", ""))))
    return out


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(spec: str | Path) -> GpuProfile:
    """A committed profile by name (`h200`, `h100`: jax_dwdp/profiles/) or a profile JSON file."""
    path = Path(spec)
    if str(spec) in profile_names():
        path = PROFILES_DIR / f"{spec}.json"
    elif not str(spec).endswith(".json") and not path.exists():
        raise PlannerError(f"{str(spec)!r}: neither a committed profile ({', '.join(profile_names())}) nor a JSON file")
    return GpuProfile.from_json(read_json_file(path, PlannerError), str(spec))


# ---- the request stream ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RequestStream:
    """Prompt lengths: `fixed` (every prompt `mean` tokens), `normal` (mean and deviation, rounded and clipped to
    [lo, hi]; each rank's queue from its own seed, as benchmarks/bench_stream.py draws them), or `file` (the lengths
    in `lengths`, dealt to the ranks in turn)."""

    kind: str
    mean: int = 0
    std: float = 0.0
    lo: int = 1
    hi: int = 0
    lengths: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self):
        if self.kind not in ("fixed", "normal", "file"):
            raise PlannerError(f"stream kind {self.kind!r}: fixed, normal or file")
        if self.kind == "file":
            if not self.lengths:
                raise PlannerError(f"{self.source or 'stream'}: no prompt lengths")
            bad = [x for x in self.lengths if x < 1]
            if bad:
                raise PlannerError(f"{self.source or 'stream'}: prompt lengths must be >= 1, got {bad[0]}")
            return
        if self.mean < 1:
            raise PlannerError(f"the mean prompt length must be >= 1 token, got {self.mean}")
        if self.kind == "normal":
            if self.std < 0:
                raise PlannerError(f"the deviation must be >= 0, got {self.std:g}")
            if not 1 <= self.lo <= self.mean <= self.hi:
                raise PlannerError(f"the clip [{self.lo}, {self.hi}] must hold the mean {self.mean} and start at >= 1")

    @staticmethod
    def fixed(tokens: int) -> "RequestStream":
        return RequestStream("fixed", mean=int(tokens), lo=int(tokens), hi=int(tokens))

    @staticmethod
    def normal(mean: int, std: float, lo: int | None = None, hi: int | None = None) -> "RequestStream":
        """bench_stream.py's `uneven` stream is normal(16384, 4096, 2048, 32768); lo, hi default to mean / 8 and
        2 * mean, as there."""
        lo = max(1, int(mean) // 8) if lo is None else int(lo)
        return RequestStream("normal", mean=int(mean), std=float(std), lo=lo, hi=2 * int(mean) if hi is None else int(hi))

    @staticmethod
    def from_file(path: str | Path) -> "RequestStream":
        """Prompt lengths from a file: whitespace- or comma-separated integers, or a JSON list."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise PlannerError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise PlannerError(f"{path}: is a folder, expected a file of prompt lengths") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlannerError(f"{path}: cannot read ({e})") from None
        words = text.strip()
        try:
            values = json.loads(words) if words.startswith("[") else [int(w) for w in words.replace(",", " ").split()]
        except (ValueError, json.JSONDecodeError):
            raise PlannerError(f"{path}: expected integers (prompt lengths) separated by spaces, commas or lines, or "
                               "a JSON list") from None
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise PlannerError(f"{path}: expected a list of integer prompt lengths")
        return RequestStream("file", lengths=tuple(values), source=str(path))

    @staticmethod
    def parse(spec: str) -> "RequestStream":
        """`16384` (fixed), `normal:MEAN,STD[,LO,HI]` or `file:PATH`."""
        if spec.startswith("file:"):
            return RequestStream.from_file(spec[5:])
        if spec.startswith("normal:"):
            try:
                parts = [float(x) for x in spec[7:].split(",")]
            except ValueError:
                raise PlannerError(f"{spec!r}: expected normal:MEAN,STD[,LO,HI] (numbers)") from None
            if len(parts) not in (2, 4):
                raise PlannerError(f"{spec!r}: expected normal:MEAN,STD[,LO,HI]")
            if any(p < 0 for p in parts):
                raise PlannerError(f"{spec!r}: lengths and deviation must not be negative")
            try:
                return RequestStream.normal(int(parts[0]), parts[1], *(int(p) for p in parts[2:]))
            except PlannerError as e:
                raise PlannerError(f"{spec!r}: {e}") from None
        try:
            tokens = int(spec.removeprefix("fixed:"))
        except ValueError:
            raise PlannerError(f"{spec!r}: expected TOKENS, normal:MEAN,STD[,LO,HI] or file:PATH") from None
        if tokens < 1:
            raise PlannerError(f"{spec!r}: prompt length must be >= 1 token, got {tokens}")
        return RequestStream.fixed(tokens)

    def queues(self, ranks: int, requests: int, seed: int = 0) -> list[list[int]]:
        """Prompt lengths per rank: `requests` each (a file: its lengths dealt in turn, `requests` ignored)."""
        if self.kind == "file":
            return [list(self.lengths[r::ranks]) for r in range(ranks)]
        if self.kind == "fixed" or self.std == 0:
            return [[self.mean] * requests for _ in range(ranks)]
        return [[int(x) for x in np.clip(np.rint(np.random.default_rng([seed, r]).normal(self.mean, self.std,
                                                                                          requests)), self.lo, self.hi)]
                for r in range(ranks)]

    def scaled(self, mean: int | None = None, std: float | None = None) -> "RequestStream":
        """The same shape at another mean (deviation and clip scaled with it) or another deviation."""
        if self.kind == "file":
            f = (mean or self.mean_length) / self.mean_length
            return dataclasses.replace(self, lengths=tuple(max(1, round(x * f)) for x in self.lengths))
        if mean is not None:
            f = mean / self.mean
            return RequestStream(self.kind, mean=int(mean), std=self.std * f, lo=max(1, round(self.lo * f)),
                                 hi=max(int(mean), round(self.hi * f)))
        if self.kind == "fixed":
            return RequestStream.normal(self.mean, std)
        return dataclasses.replace(self, std=float(std))

    @property
    def mean_length(self) -> float:
        return float(np.mean(self.lengths)) if self.kind == "file" else float(self.mean)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"every prompt {self.mean} tokens"
        if self.kind == "normal":
            return f"normal, mean {self.mean}, deviation {self.std:g}, clipped to [{self.lo}, {self.hi}]"
        return f"{len(self.lengths)} prompt lengths from {self.source} (mean {self.mean_length:.0f})"

    def to_json(self) -> dict:
        out = {"kind": self.kind, "description": self.describe()}
        if self.kind == "file":
            out.update(source=self.source, count=len(self.lengths), mean=self.mean_length)
        else:
            out.update(mean=self.mean, std=self.std, lo=self.lo, hi=self.hi)
        return out


def prediction_inputs(profile: str | Path, link: str | None = None, stream: str | None = None, *,
                      dtype: str = "bfloat16") -> tuple[GpuProfile, Link, RequestStream]:
    """`predict`'s measured inputs, read: the GPU profile (`load_profile`), the link (`load_link`; default the
    profile's own) and the stream of prompt lengths (`RequestStream.parse`; default DEFAULT_STREAM), each error
    naming the parameter it came from; refused when the profile was measured in another precision than `dtype`
    (its layer times would not apply)."""
    read = {}
    for name, load in (("profile", lambda: load_profile(profile)), ("link", lambda: load_link(link, read["profile"])),
                       ("stream", lambda: RequestStream.parse(DEFAULT_STREAM if stream is None else stream))):
        try:
            read[name] = load()
        except PlannerError as e:
            raise PlannerError(f"${name} {e}") from None
    if dtype != read["profile"].dtype:
        raise PlannerError(f"$profile {profile} was measured in {read['profile'].dtype}; $dtype {dtype} has no "
                           "measured layer times")
    return read["profile"], read["link"], read["stream"]


# ---- per-layer compute -------------------------------------------------------------------------------------------


def _flops_per_token(cfg: ModelConfig) -> dict:
    """Matmul FLOPs per token of each part (the attention core's per token per context token)."""
    h = cfg.hidden_size
    gdn_proj = 2 * (h * (cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads)
                    + cfg.linear_value_dim * h)
    gdn_core = 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    attn_proj = 2 * (h * cfg.num_attention_heads * cfg.head_dim * 2 + 2 * h * cfg.num_key_value_heads * cfg.head_dim
                     + cfg.num_attention_heads * cfg.head_dim * h)
    attn_core = 2 * cfg.num_attention_heads * cfg.head_dim  # x T context tokens (causal: 4 * heads * d * T / 2)
    moe = 2 * (cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
               + 3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts + h)
    moe_weights = (cfg.num_experts * 3 * h * cfg.moe_intermediate_size + 3 * h * cfg.shared_expert_intermediate_size
                   + h * cfg.num_experts + h)
    return {"linear": gdn_proj + gdn_core, "linear_weights": gdn_proj, "attn_proj": attn_proj, "attn_core": attn_core,
            "moe": moe, "moe_weights": moe_weights}


def _shape(cfg: ModelConfig) -> tuple:
    return tuple(getattr(cfg, k) for k in REQUIRED_KEYS if k not in ("vocab_size", "num_hidden_layers"))


@dataclasses.dataclass(frozen=True)
class LayerCompute:
    """A layer's mixer and MoE time by tokens, for a model on a profile's GPU: the profile's fits, scaled when the
    model's shapes are not the profile's (`scaled` says so): the per-token terms by FLOPs per token, the T^2 term
    by attention's core, the constant by the weights' bytes (what a layer reads however few its tokens)."""

    mixer: dict  # kind -> Fit
    moe: Fit
    scaled: bool

    @staticmethod
    def of(cfg: ModelConfig, profile: GpuProfile) -> "LayerCompute":
        if _shape(cfg) == _shape(profile.model):
            return LayerCompute(dict(profile.mixer), profile.moe, False)
        new, ref = _flops_per_token(cfg), _flops_per_token(profile.model)
        f = {k: new[k] / ref[k] for k in new}
        mixer = {LINEAR_ATTENTION: profile.mixer[LINEAR_ATTENTION].scaled(f["linear_weights"], f["linear"]),
                 FULL_ATTENTION: profile.mixer[FULL_ATTENTION].scaled(f["attn_proj"], f["attn_proj"],
                                                                      f["attn_core"])}
        return LayerCompute(mixer, profile.moe.scaled(f["moe_weights"], f["moe"]), True)

    @staticmethod
    def constant(mixer_ms: dict, moe_ms: float) -> "LayerCompute":
        """Fixed times (a measured row's, at its own tokens): for checking the model against that row."""
        const = lambda ms: Fit(((0, ms, "given"),), 0, (ms, 0.0, 0.0))  # noqa: E731
        return LayerCompute({k: const(v) for k, v in mixer_ms.items()}, const(moe_ms), False)

    def times(self, kinds, tokens: int) -> tuple[list[float], list[float]]:
        """Per layer (mixer ms, MoE ms) at `tokens` (0 tokens: nothing to do)."""
        if tokens <= 0:
            return [0.0] * len(kinds), [0.0] * len(kinds)
        return [self.mixer[k](tokens) for k in kinds], [self.moe(tokens)] * len(kinds)


# ---- DWDP: the two streams of one rank ---------------------------------------------------------------------------


def dwdp_timeline(mixer: list[float], moe: list[float], copy_ms: float, copy_slowdown: float,
                  compute_loss: float) -> dict:
    """One rank's prefill through the layers with DWDP's prefetch, as the runner issues it: layer 0's copy before
    layer 0, layer l+1's when layer l starts (after everything enqueued before it, and after layer l's copy: one copy
    stream); layer l's MoE waits for its copy. While both streams run, the copy goes `copy_slowdown` times slower
    than on an idle GPU and the compute loses `compute_loss` ms per ms; a copy alone (the compute waiting for it)
    runs at the idle rate. `copy_ms` is a layer's copy on an idle GPU.

    Returns the total ms, per layer its start, end, copy time (issue to done, from its start on the copy stream),
    the time the MoE waited for it (stall) and the ms the compute lost to the copy (contention), and the first
    layer's exposed prefetch (layer 0's stall)."""
    n = len(mixer)
    tasks = []  # ("issue", j) | ("work", ms, layer) | ("wait", layer)
    for layer in range(n):
        if layer + 1 < n:
            tasks.append(("issue", layer + 1))
        tasks.append(("start", layer))
        tasks.append(("work", mixer[layer], layer))
        tasks.append(("wait", layer))
        tasks.append(("work", moe[layer], layer))
    tasks.insert(0, ("issue", 0))
    t = 0.0
    queue = []  # copies not yet done, in order: [layer, remaining idle-ms]
    started, done = {}, {}
    start, end = [0.0] * n, [0.0] * n
    stall, lost = [0.0] * n, [0.0] * n
    i, remaining, current = 0, None, 0
    while i < len(tasks):
        task = tasks[i]
        if task[0] == "issue":
            queue.append([task[1], copy_ms])
            i += 1
            continue
        if task[0] == "start":
            start[task[1]] = t
            current = task[1]
            i += 1
            continue
        if task[0] == "wait" and task[1] in done:
            i += 1
            continue
        if task[0] == "work" and remaining is None:
            remaining = task[1]
        if queue and queue[0][0] not in started:
            started[queue[0][0]] = t
        computing = task[0] == "work"
        copying = bool(queue)
        compute_rate = (1.0 - compute_loss) if copying else 1.0
        copy_rate = (1.0 / copy_slowdown) if computing else 1.0
        dt_compute = remaining / compute_rate if computing else math.inf
        dt_copy = queue[0][1] / copy_rate if copying else math.inf
        dt = min(dt_compute, dt_copy)
        if not math.isfinite(dt):  # waiting for a copy that was never issued: cannot happen in this schedule
            raise AssertionError("DWDP timeline: a wait with no copy in flight")
        if computing and copying:
            lost[current] += compute_loss * dt
        if task[0] == "wait":
            stall[current] += dt
        t += dt
        if computing:
            remaining -= dt * compute_rate
        if copying:
            queue[0][1] -= dt * copy_rate
            if dt == dt_copy:
                layer, _ = queue.pop(0)
                done[layer] = t
        if computing and dt == dt_compute:
            remaining = None
            end[current] = t
            i += 1
    copies = [done[j] - started[j] for j in range(n)]
    return {"total_ms": t, "start_ms": start, "end_ms": end, "copy_ms": copies, "stall_ms": stall,
            "contention_ms": lost, "first_layer_exposed_ms": stall[0] if n else 0.0}


def calibrate_compute_loss(mixer: list[float], moe: list[float], copy_ms: float, copy_slowdown: float,
                           measured_ms: float) -> float:
    """The `compute_loss` at which `dwdp_timeline` gives `measured_ms` (a two-GPU or one-GPU measurement of the
    same layers with the copies), by bisection; 0 when even no loss is slower than measured."""
    lo, hi = 0.0, 0.95
    if dwdp_timeline(mixer, moe, copy_ms, copy_slowdown, 0.0)["total_ms"] >= measured_ms:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if dwdp_timeline(mixer, moe, copy_ms, copy_slowdown, mid)["total_ms"] < measured_ms:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---- the prediction ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the prediction needs from the model and the layout: the layer kinds per stage, the bytes that move."""

    cfg: ModelConfig
    pipeline: int
    ranks: int
    itemsize: int
    stages: tuple[tuple[str, ...], ...]  # per stage, its layers' kinds
    stage_layers: tuple[tuple[int, int], ...]
    store_mode: str | None = None  # None: what rank_memory says the FFI store does (in place or copying out)

    @staticmethod
    def of(cfg: ModelConfig, pipeline: int, ranks: int, itemsize: int = 2, boundaries=None,
           store_mode: str | None = None) -> "Layout":
        ExpertLayout(cfg.num_experts, ranks)  # refuses more ranks than experts
        stages = plan_stages(cfg, pipeline, boundaries)
        return Layout(cfg, pipeline, ranks, itemsize,
                      tuple(tuple(cfg.layer_types[s.start_layer:s.end_layer]) for s in stages),
                      tuple((s.start_layer, s.end_layer) for s in stages), store_mode)

    def with_ranks(self, ranks: int) -> "Layout":
        ExpertLayout(self.cfg.num_experts, ranks)
        return dataclasses.replace(self, ranks=ranks)

    def copy_bytes(self) -> tuple[int, int, str]:
        """DWDP per layer and rank: (bytes from the peers over the link, own bytes copied HBM to HBM, store mode).
        The peers' share is (N-1)/N of the layer's experts (exactly: the experts rank 0 does not own)."""
        if self.ranks == 1:
            return 0, 0, "none"
        layout = ExpertLayout(self.cfg.num_experts, self.ranks)
        mem = rank_memory(self.cfg, layout, 0, 1, self.itemsize)
        mode = self.store_mode or mem["store_mode"]
        own = len(layout.owned(0)) * expert_bytes_per_layer(self.cfg, self.itemsize) if mode == "copy" else 0
        return mem["peer_bytes_per_layer"], own, mode

    def dep_fanout(self, exchange: str = "gather") -> float:
        """Ranks other than its own that a token of a DEP rank goes to: all N - 1 with `gather`; with `routed` the
        expected number holding one of its top-k experts (E / N experts each, k drawn without replacement)."""
        n, k, e = self.ranks, self.cfg.num_experts_per_tok, self.cfg.num_experts
        if n == 1:
            return 0.0
        if exchange == "gather":
            return float(n - 1)
        per = e / n
        if e - per - k + 1 <= 0:
            return float(n - 1)
        return (n - 1) * (1 - math.exp(math.lgamma(e - per + 1) + math.lgamma(e - k + 1)
                                       - math.lgamma(e - per - k + 1) - math.lgamma(e + 1)))

    def dep_bytes(self, tokens: int, exchange: str = "gather") -> int:
        """DEP per layer and rank, received: `gather` (jax_dwdp's: every rank's tokens, ids and weights gathered to
        every rank, the partial sums sent back by one all-to-all) or `routed` (each token only to the ranks holding
        one of its top-k experts, and its partial sum back: what a dispatch kernel such as DeepEP sends; even
        routing)."""
        h, k, b = self.cfg.hidden_size, self.cfg.num_experts_per_tok, self.itemsize
        other = self.dep_fanout(exchange)
        if exchange == "gather":
            return int(other * tokens * (h * b + k * (4 + b)) + other * tokens * h * b)
        return int(2 * other * tokens * (h * b + 8))


def _ms(nbytes: float, gib_s: float) -> float:
    return nbytes / (gib_s * GIB) * 1e3


class Predictor:
    """Predictions for one model, profile, link and layout; requests of the same length are computed once."""

    def __init__(self, layout: Layout, profile: GpuProfile, link: Link, *, dep_exchange: str = "gather",
                 compute: LayerCompute | None = None, contention: tuple[float, float] | None = None):
        if dep_exchange not in DEP_EXCHANGES:
            raise PlannerError(f"DEP exchange {dep_exchange!r}: choose one of {', '.join(DEP_EXCHANGES)}")
        self.layout, self.profile, self.link, self.dep_exchange = layout, profile, link, dep_exchange
        self.compute = compute or LayerCompute.of(layout.cfg, profile)
        self.fixed_contention = contention
        peer, own, self.store_mode = layout.copy_bytes()
        self.peer_bytes, self.own_bytes = peer, own
        self.copy_idle_ms = _ms(peer, link.peer_gib_s) + _ms(own, profile.copy_gib_s.value)
        self._dwdp = functools.lru_cache(maxsize=None)(self._dwdp_uncached)

    def contention(self, tokens: int) -> tuple[float, float]:
        return self.fixed_contention or self.profile.contention.at(tokens)

    # per request (one rank, one stage)
    def replicated_ms(self, stage: int, tokens: int) -> float:
        mixer, moe = self.compute.times(self.layout.stages[stage], tokens)
        return sum(mixer) + sum(moe)

    def dwdp(self, stage: int, tokens: int) -> dict:
        return self._dwdp(stage, tokens)

    def _dwdp_uncached(self, stage: int, tokens: int) -> dict:
        mixer, moe = self.compute.times(self.layout.stages[stage], tokens)
        if self.layout.ranks == 1 or tokens <= 0:
            total = sum(mixer) + sum(moe)
            n = len(mixer)
            return {"total_ms": total, "copy_ms": [0.0] * n, "stall_ms": [0.0] * n, "contention_ms": [0.0] * n,
                    "first_layer_exposed_ms": 0.0, "mixer_ms": mixer, "moe_ms": moe}
        slow, loss = self.contention(tokens)
        out = dwdp_timeline(mixer, moe, self.copy_idle_ms, slow, loss)
        return {**out, "mixer_ms": mixer, "moe_ms": moe}

    def dep_step(self, stage: int, lengths: list[int]) -> dict:
        """One lockstep DEP step of a stage: rank r prefills lengths[r]; every layer waits for the slowest rank at
        the MoE exchange. `gather` (jax_dwdp): every rank computes the step's longest prompt (padded) and exchanges
        that many tokens; `routed`: each rank computes its own prompt, its experts the step's tokens / N."""
        kinds = self.layout.stages[stage]
        longest = max(lengths)
        own = [self.compute.times(kinds, t) for t in lengths]
        if self.dep_exchange == "gather":
            mixer, moe = self.compute.times(kinds, longest)
            exchange_tokens = longest
        else:
            mixer = [max(m[0][i] for m in own) for i in range(len(kinds))]
            moe = self.compute.times(kinds, math.ceil(sum(lengths) / len(lengths)))[1]
            exchange_tokens = longest
        nbytes = self.layout.dep_bytes(exchange_tokens, self.dep_exchange)
        collectives = 2 if self.layout.ranks > 1 else 0
        exchange = _ms(nbytes, self.link.collective_gib_s) + collectives * self.link.latency_us / 1e3
        layer = [mx + me + exchange for mx, me in zip(mixer, moe)]
        total = sum(layer)
        busy = [sum(m[0]) + sum(m[1]) for m in own]  # each rank's own prompt, unpadded
        return {"total_ms": total, "layer_ms": layer, "mixer_ms": mixer, "moe_ms": moe, "exchange_ms": exchange,
                "exchange_bytes": nbytes, "wait_ms": [total - exchange * len(kinds) - b for b in busy]}

    # the stream
    def serve(self, queues: list[list[int]], bucket: int = 1) -> dict:
        """The three schemes over per-rank queues of prompt lengths (all queued at t = 0, as bench_stream.py):
        DWDP and replicated ranks each take their next request as soon as they finish one; DEP takes the next
        request of every rank per lockstep step. Prompts are computed padded to `bucket` tokens; only real tokens
        count. Pipeline stages: each request (or DEP step) flows through the stages in order (a stage starts it
        when it has finished the previous one and the stage before has handed it over: the hidden states over the
        link)."""
        n, stages = self.layout.ranks, len(self.layout.stages)
        h, b = self.layout.cfg.hidden_size, self.layout.itemsize
        pad = lambda t: -(-t // bucket) * bucket  # noqa: E731
        real = sum(sum(q) for q in queues)

        def handover(t):
            return _ms(t * h * b, self.link.peer_gib_s) if stages > 1 else 0.0

        def flow(units):  # units: per unit, per stage ms (the handover before it is added)
            end = [0.0] * stages
            for unit in units:
                prev = 0.0
                for s in range(stages):
                    end[s] = max(end[s], prev) + unit[s]
                    prev = end[s]
            return end[-1]

        out = {}
        for scheme in ("dwdp", "replicated"):
            spans, copy = [], 0.0
            for q in queues:
                units = []
                for t in q:
                    per = []
                    for s in range(stages):
                        if scheme == "dwdp":
                            d = self.dwdp(s, pad(t))
                            per.append(d["total_ms"] + (handover(pad(t)) if s else 0.0))
                            copy += sum(d["copy_ms"])
                        else:
                            per.append(self.replicated_ms(s, pad(t)) + (handover(pad(t)) if s else 0.0))
                    units.append(per)
                spans.append(flow(units))
            out[scheme] = {"makespan_ms": max(spans), "rank_busy_ms": spans}
            if scheme == "dwdp":
                out[scheme]["copy_ms_per_rank"] = copy / n
        steps = []
        for j in range(max(len(q) for q in queues)):
            lengths = [pad(q[j]) if j < len(q) else 0 for q in queues]
            steps.append([self.dep_step(s, lengths)["total_ms"] + (handover(max(lengths)) if s else 0.0)
                          for s in range(stages)])
        out["dep"] = {"makespan_ms": flow(steps), "steps": len(steps)}
        for scheme in out:
            out[scheme]["tokens_per_s_per_gpu"] = real / (out[scheme]["makespan_ms"] / 1e3) / (n * stages)
        rep = out["replicated"]["makespan_ms"]
        dwdp = out["dwdp"]
        dwdp["hidden_fraction"] = (1 - min(1.0, max(0.0, dwdp["makespan_ms"] - rep) / dwdp["copy_ms_per_rank"])
                                   if dwdp["copy_ms_per_rank"] > 0 else None)
        return out


def weight_bytes(cfg: ModelConfig, start: int, end: int, itemsize: int) -> tuple[int, int]:
    """(all weights, non-expert weights) of the layers [start, end) and, on the first / last stage, the embedding /
    the final norm and head: from shapes, as `plan`'s weight_bytes (A_log is kept in fp32)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    attn = h * cfg.num_attention_heads * cfg.head_dim * 2 + 2 * h * cfg.num_key_value_heads * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * h + 2 * cfg.head_dim
    gdn = h * (cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads)
    gdn += cfg.conv_dim * cfg.linear_conv_kernel_dim + cfg.linear_value_dim * h
    gdn += 2 * cfg.linear_num_value_heads + cfg.linear_value_head_dim
    dense_per_layer = 2 * h + e * h + 3 * h * cfg.shared_expert_intermediate_size + h
    total, non_expert = 0, 0
    for layer in range(start, end):
        mixer = attn if cfg.layer_types[layer] == FULL_ATTENTION else gdn
        extra = 0 if cfg.layer_types[layer] == FULL_ATTENTION else cfg.linear_num_value_heads * (4 - itemsize)
        non_expert += (mixer + dense_per_layer) * itemsize + extra
        total += e * 3 * h * i * itemsize
    if start == 0:
        non_expert += cfg.vocab_size * h * itemsize
    if end == cfg.num_hidden_layers:  # the head is its own array, tied or not
        non_expert += (h + cfg.vocab_size * h) * itemsize
    return total + non_expert, non_expert


def memory_per_rank(layout: Layout, longest: int, profile: GpuProfile | None = None,
                    dep_exchange: str = "gather") -> dict:
    """Per scheme, the largest rank's bytes: resident weights (`rank_memory`), what its experts need besides (DWDP:
    the store's slots or prefetch buffers; DEP: the exchange's buffers for the longest prompt), and the caches of one
    prompt of `longest` tokens; activations are not counted. With a profile, whether each fits its GPU."""
    cfg, n, b = layout.cfg, layout.ranks, layout.itemsize
    out = {"dwdp": 0, "dep": 0, "replicated": 0}
    stages = []
    for (start, end), kinds in zip(layout.stage_layers, layout.stages):
        total, non_expert = weight_bytes(cfg, start, end, b)
        n_full = sum(k == FULL_ATTENTION for k in kinds)
        cache = 2 * n_full * cfg.num_key_value_heads * cfg.head_dim * b * longest
        cache += (len(kinds) - n_full) * (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * b
                                          + cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                          * cfg.linear_value_head_dim * 4)
        mem = rank_memory(cfg, ExpertLayout(cfg.num_experts, n), 0, len(kinds), b, prefetch=n > 1,
                          non_expert_bytes=non_expert)
        mode = layout.store_mode or mem["store_mode"]
        buffers = mem["store_slot_bytes"] if mode == "in_place" else mem["prefetch_buffer_bytes"]
        if mode == "copy" and not mem["prefetch_buffer_bytes"] and n > 1:
            buffers = 2 * cfg.num_experts * expert_bytes_per_layer(cfg, b)
        # the tokens received (with `gather`, every rank's, at the longest prompt's static size), their partial
        # sums, and the partial sums that come back
        exchange = int(3 * (layout.dep_fanout(dep_exchange) + 1) * longest * cfg.hidden_size * b) if n > 1 else 0
        stage = {"dwdp": mem["resident_bytes"] + buffers + cache, "dep": mem["resident_bytes"] + exchange + cache,
                 "replicated": total + cache}
        for k in out:
            out[k] = max(out[k], stage[k])
        stages.append({"resident_bytes": mem["resident_bytes"], "replicated_bytes": total,
                       "dwdp_buffer_bytes": buffers, "dep_exchange_bytes": exchange, "cache_bytes": cache,
                       "store_mode": mode})
    result = {k: {"bytes": v} for k, v in out.items()}
    if profile is not None:
        limit = profile.memory_gib.value * GIB
        for v in result.values():
            v["fits"] = v["bytes"] <= limit
    result["stages"] = stages
    return result


def predict(cfg: ModelConfig, profile: GpuProfile, link: Link, stream: RequestStream, *, pipeline: int = 1,
            ranks: int = 2, requests: int = 8, seed: int = 0, bucket: int = 256, itemsize: int = 2,
            boundaries=None, dep_exchange: str = "gather", crossover: bool = True) -> dict:
    """Everything `jax-dwdp plan --profile` prints: per scheme the makespan and tokens/s per GPU over the stream,
    per layer of stage 0 the times of the stream's first step, per step the three schemes, memory per rank, and the
    crossovers (DWDP / DEP against prompt length, imbalance and N)."""
    if not isinstance(cfg, ModelConfig):
        raise PlannerError(NOT_MODELLED)
    if requests < 1:
        raise PlannerError(f"$requests must be >= 1 per rank, got {requests}")
    if bucket < 1:
        raise PlannerError(f"$bucket must be >= 1 token, got {bucket}")
    if not 0 <= seed <= MAX_SEED:
        raise PlannerError(f"$stream_seed must lie in [0, {MAX_SEED}], got {seed}", stream_seed="seed")
    layout = Layout.of(cfg, pipeline, ranks, itemsize, boundaries)
    p = Predictor(layout, profile, link, dep_exchange=dep_exchange)
    queues = stream.queues(ranks, requests, seed)
    if not all(queues) and stream.kind == "file":
        raise PlannerError(f"{stream.source}: {sum(map(len, queues))} prompt lengths for {ranks} ranks: need at least "
                           "one per rank")
    pad = lambda t: -(-t // bucket) * bucket  # noqa: E731
    served = p.serve(queues, bucket)
    rep = served["replicated"]["tokens_per_s_per_gpu"]
    longest = pad(max(max(q) for q in queues))
    memory = memory_per_rank(layout, longest, profile, dep_exchange)
    schemes = {}
    for name in ("dwdp", "dep", "replicated"):
        s = served[name]
        schemes[name] = {"makespan_ms": s["makespan_ms"], "tokens_per_s_per_gpu": s["tokens_per_s_per_gpu"],
                         "vs_replicated": s["tokens_per_s_per_gpu"] / rep, "memory_bytes": memory[name]["bytes"],
                         "fits": memory[name]["fits"]}
    schemes["dwdp"]["hidden_fraction"] = served["dwdp"]["hidden_fraction"]
    first = [pad(q[0]) for q in queues]
    per_layer = _per_layer(p, 0, first)
    steps = []
    for j in range(min(len(q) for q in queues)):
        lengths = [pad(q[j]) for q in queues]
        dep = p.dep_step(0, lengths)
        steps.append({"tokens": lengths, "dwdp_ms": [p.dwdp(0, t)["total_ms"] for t in lengths],
                      "replicated_ms": [p.replicated_ms(0, t) for t in lengths], "dep_ms": dep["total_ms"],
                      "dep_wait_ms": dep["wait_ms"]})
    out = {
        "profile": profile.summary(), "link": link.to_json(), "stream": stream.to_json(),
        "requests_per_rank": len(queues[0]), "seed": seed, "bucket": bucket, "ranks": ranks, "pipeline": pipeline,
        "dep_exchange": dep_exchange, "compute_scaled_from_profile_model": p.compute.scaled,
        "dwdp_copy": {"peer_bytes_per_layer": p.peer_bytes, "own_bytes_per_layer": p.own_bytes,
                      "store_mode": p.store_mode, "idle_ms_per_layer": p.copy_idle_ms,
                      "link_gib_s": link.peer_gib_s},
        "schemes": schemes, "dwdp_over_dep": schemes["dwdp"]["tokens_per_s_per_gpu"]
        / schemes["dep"]["tokens_per_s_per_gpu"], "per_layer": per_layer, "steps": steps,
        "memory": {k: v for k, v in memory.items()}, "leaves_out": list(LEAVES_OUT),
    }
    if crossover:
        out["crossover"] = crossovers(layout, profile, link, stream, requests=requests, seed=seed, bucket=bucket,
                                      dep_exchange=dep_exchange)
    return out


def _per_layer(p: Predictor, stage: int, lengths: list[int]) -> list[dict]:
    """Stage `stage`'s layers for one step (rank r prefills lengths[r]): DWDP and replicated averaged over the
    ranks, DEP's step."""
    dwdp = [p.dwdp(stage, t) for t in lengths]
    dep = p.dep_step(stage, lengths)
    start = p.layout.stage_layers[stage][0]
    rows = []
    for i, kind in enumerate(p.layout.stages[stage]):
        mean = lambda key: float(np.mean([d[key][i] for d in dwdp]))  # noqa: E731
        rows.append({
            "layer": start + i, "kind": kind, "mixer_ms": mean("mixer_ms"), "moe_ms": mean("moe_ms"),
            "dwdp_copy_ms": mean("copy_ms"), "dwdp_stall_ms": mean("stall_ms"),
            "dwdp_contention_ms": mean("contention_ms"),
            "dep_layer_ms": dep["layer_ms"][i], "dep_exchange_ms": dep["exchange_ms"],
            "dep_exchange_bytes": dep["exchange_bytes"],
            "dep_wait_ms": float(np.mean([dep["mixer_ms"][i] - d["mixer_ms"][i] + dep["moe_ms"][i] - d["moe_ms"][i]
                                          for d in dwdp])),
        })
    return rows


def ratio(layout: Layout, profile: GpuProfile, link: Link, stream: RequestStream, *, requests: int = 8,
          seed: int = 0, bucket: int = 256, dep_exchange: str = "gather") -> float:
    """DWDP / DEP in tokens/s per GPU over the stream."""
    p = Predictor(layout, profile, link, dep_exchange=dep_exchange)
    s = p.serve(stream.queues(layout.ranks, requests, seed), bucket)
    return s["dwdp"]["tokens_per_s_per_gpu"] / s["dep"]["tokens_per_s_per_gpu"]


LENGTH_GRID = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
IMBALANCE_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
RANK_GRID = (2, 4, 8, 16, 32, 64, 72, 128, 256)


def crossing(xs, ys, log: bool) -> float | None:
    """The first x where y - 1 changes sign (linear interpolation, in log x if `log`)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), list(zip(xs, ys))[1:]):
        if (y0 - 1) * (y1 - 1) < 0 or (y0 != 1 and y1 == 1):
            f = (1 - y0) / (y1 - y0)
            return float(2 ** (math.log2(x0) + f * (math.log2(x1) - math.log2(x0)))) if log else x0 + f * (x1 - x0)
    return None


def crossovers(layout: Layout, profile: GpuProfile, link: Link, stream: RequestStream, *, requests: int = 8,
               seed: int = 0, bucket: int = 256, dep_exchange: str = "gather") -> dict:
    """Where DWDP / DEP (tokens/s per GPU) crosses 1: against the stream's mean prompt length (its shape kept),
    against imbalance (deviation / mean, at the stream's mean), and against N ranks (the experts' count caps N).
    Each: the grid, the ratio on it, and the crossing (None: no crossing on the grid)."""
    kw = dict(requests=requests, seed=seed, bucket=bucket, dep_exchange=dep_exchange)
    out = {}
    lengths = [x for x in LENGTH_GRID]
    r = [ratio(layout, profile, link, stream.scaled(mean=x), **kw) for x in lengths]
    out["prompt_tokens"] = {"grid": lengths, "dwdp_over_dep": r, "crossing": crossing(lengths, r, True)}
    mean = int(round(stream.mean_length))
    base = RequestStream.fixed(mean) if stream.kind == "file" else stream
    imb = list(IMBALANCE_GRID)
    r = [ratio(layout, profile, link, base.scaled(std=f * mean) if f else RequestStream.fixed(mean), **kw)
         for f in imb]
    out["imbalance"] = {"grid": imb, "dwdp_over_dep": r, "crossing": crossing(imb, r, False)}
    ranks = [n for n in RANK_GRID if n <= layout.cfg.num_experts]
    r = [ratio(layout.with_ranks(n), profile, link, stream, **kw) for n in ranks]
    out["ranks"] = {"grid": ranks, "dwdp_over_dep": r, "crossing": crossing(ranks, r, True)}
    return out

