"""A prefill driver built from a spec: what `jax-dwdp prefill` runs, for notebooks and scripts too.

    spec = PrefillSpec(preset="tiny", pipeline=2, ranks=2, experts="xla")
    tokens, lengths = prefill_inputs(spec, spec.config(), batch=2, seq_len=128)   # or your [B, T] ids
    with build_driver(spec) as driver:
        logits, caches = driver.run(tokens, lengths)
        result = measure(driver, tokens, lengths, iters=3)

`build_driver` picks the one driver that runs the spec: a `Pipeline` (stages, microbatches or ranks), a scanned
model on one device, a chunked prefill (pieces that continue a cache), or `jit_prefill`. Its `run(tokens,
lengths)` returns (logits, [one cache per stage]). `prefill_inputs` makes (random ids) or takes the tokens and
refuses what the spec cannot run before anything is built: the checks `jax-dwdp prefill` makes of its inputs. The
spec's fields are the CLI's options (docs/cli.md). A spec checks its own fields when it is made (ranges, fields that
do not combine), `config()` and `prefill_inputs` check them against the model: a `SpecError` naming the fields,
which the CLI names by its flags (options.OptionError).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp import distributed
from jax_dwdp.config import ConfigError, ModelConfig
from jax_dwdp.families import FamilyConfig, config_from_preset
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.model import init_model, with_kernels
from jax_dwdp.model.cache import Cache, LogitsMode
from jax_dwdp.options import MAX_SEED, OptionError, check_dtype
from jax_dwdp.parallel.backends import BACKENDS, expert_backend
from jax_dwdp.parallel.checkpoint_layers import CheckpointLayers
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.parallel.pipeline import Pipeline, cache_bytes_per_sequence, cache_bytes_per_token, microbatch_rows
from jax_dwdp.parallel.pipeline import check_layout, plan_stages
from jax_dwdp.prefill import InputError, check_tokens, jit_decode_step, jit_prefill
from jax_dwdp.runner import DEFAULT_MODE, execution_mode
from jax_dwdp.scan import ScannedModel, jit_prefill_scanned
from jax_dwdp.generate import greedy
from jax_dwdp.progress import shown_on
from jax_dwdp.watchdog import Watchdog
from jax_dwdp.weights import CheckpointError, load_checkpoint
from jax_dwdp.weights.hf_loader import load_config


class SpecError(OptionError):
    """A spec that cannot run: fields out of range or that do not combine, or a layout that the model or this
    machine's devices cannot take; the message says why (naming the fields as options.OptionError does)."""


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """What to prefill and how: the model (an HF / Orbax `checkpoint` folder or a `preset`'s random weights), its
    precision, the layout (pipeline stages x ranks per stage, the expert backend), the execution mode, and the
    logits to return ("all" positions or each sequence's "last"). Fields out of range or that do not combine raise
    SpecError when the spec is made."""

    checkpoint: str | Path | None = None
    preset: str | None = None  # "FAMILY:NAME" (nemotron-h:tiny) or a bare Qwen3.5-MoE name (families.preset_names)
    num_layers: int | None = None  # keep only the first layers (of a checkpoint: load only those)
    dtype: str = "bfloat16"  # one of options.DTYPES
    seed: int = 0  # of random weights, in [0, MAX_SEED]
    pipeline: int = 1
    ranks: int = 1  # per stage
    experts: str | None = None  # a word of parallel.backends.BACKENDS; default "xla" over ranks, else "local"
    microbatches: int = 1
    stage_boundaries: tuple[int, ...] | None = None
    mode: str = DEFAULT_MODE  # whole | layerwise | scanned (runner.MODES)
    prefill_chunk: int | None = None  # tokens per piece of a chunked prefill (one device)
    fused_swiglu: bool = False
    logits: LogitsMode = "last"
    kernels: KernelChoices | None = None  # the kernel choices (default: the process's, from the environment)
    cache_len: int | None = None  # positions each cache holds (default the prompt's; more leaves room to decode)

    def __post_init__(self):
        if (self.checkpoint is None) == (self.preset is None):
            raise SpecError("a PrefillSpec names a $checkpoint or a $preset (one of them)")
        execution_mode(self.mode)
        check_dtype(self.dtype, SpecError)
        if not 0 <= self.seed <= MAX_SEED:
            raise SpecError(f"$seed must lie in [0, {MAX_SEED}], got {self.seed}")
        for name in ("pipeline", "ranks", "microbatches"):
            if getattr(self, name) < 1:
                raise SpecError(f"${name} must be >= 1, got {getattr(self, name)}")
        if self.stage_boundaries and self.pipeline == 1:
            raise SpecError("$stage_boundaries needs $pipeline P with P >= 2 stages")
        if self.experts is not None and self.experts not in BACKENDS:
            raise SpecError(f"$experts {self.experts!r}: choose one of {', '.join(BACKENDS)}")
        scanned = dict(scan="mode 'scanned'")
        if self.prefill_chunk is not None:
            if self.prefill_chunk < 1:
                raise SpecError(f"$prefill_chunk must be >= 1, got {self.prefill_chunk}")
            if self.spread:
                raise SpecError("$prefill_chunk runs on one device: it does not combine with $pipeline, $ranks or "
                                "$microbatches")
            if self.mode == "scanned":  # (a scanned program has no layer boundary to continue a cache at)
                raise SpecError("$prefill_chunk continues a cache layer by layer: not with $scan", **scanned)
        if self.mode == "scanned" and self.ranks > 1:
            raise SpecError("$scan runs the model (or each $pipeline stage) on one device as one program: not with "
                            "$ranks > 1 (their experts move between layers)", **scanned)

    @property
    def experts_word(self) -> str:
        return self.experts or ("xla" if self.ranks > 1 else "local")

    @property
    def spread(self) -> bool:
        """Whether the spec runs through a Pipeline (several stages, microbatches or ranks)."""
        return self.pipeline > 1 or self.microbatches > 1 or self.ranks > 1

    def config(self) -> FamilyConfig:
        """The model's config (a checkpoint's config.json or the preset, of its family), cut to `num_layers`."""
        cfg = load_config(self.checkpoint) if self.checkpoint is not None else config_from_preset(self.preset)
        if self.num_layers is not None:
            if not 1 <= self.num_layers <= cfg.num_hidden_layers:
                raise SpecError(f"$num_layers must lie in [1, {cfg.num_hidden_layers}], got {self.num_layers}")
            cfg = cfg.first_layers(self.num_layers)
        return cfg


class Driver:
    """A built prefill: run(tokens, lengths) -> (logits, [cache per stage]); compile(tokens, lengths) compiles
    ahead of time; `description` says what runs; `reports` whether this process reports results (one process per
    device: the last stage's); `close()` (or leaving a `with` block) releases what the driver opened."""

    def __init__(self, spec: PrefillSpec, cfg: FamilyConfig, run, compile_fn, description: str, *, close=None,
                 reports: bool = True, model=None):
        self.spec, self.cfg, self.run, self.compile = spec, cfg, run, compile_fn
        self.description, self.reports, self._close = description, reports, close
        self._model = model  # the whole model on one device, when the driver runs one (else made for decoding)

    def generate(self, last_logits, caches, n: int, lengths=None):
        """n greedy tokens per sequence [B, n] continuing the prefill whose last-position logits [B, V] and caches
        (one per stage) are given, with the model's reference decode step on one device (correctness, not speed:
        a driver over stages or ranks builds the whole model there once for it). The caches need room for n - 1
        more positions (`PrefillSpec.cache_len`). `lengths` [B]: the prompt lengths (rows past them are padding)."""
        batch = np.asarray(last_logits).shape[0]
        device = jax.devices()[0]
        cache = Cache.concat_layers(list(caches), device) if len(caches) > 1 else jax.device_put(caches[0], device)
        if cache.lengths.shape[0] > batch:  # microbatch padding rows
            cache = jax.tree.map(lambda x: x[:batch] if x.ndim == 1 else x[:, :batch], cache)
        if self._model is None:
            self._model = _whole_model(self.spec, self.cfg)
        return greedy(jit_decode_step(self._model), last_logits, cache, n)

    def close(self, exc: BaseException | None = None) -> None:
        if self._close is not None:
            close, self._close = self._close, None
            close(exc)

    def __enter__(self) -> "Driver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


def preflight(spec: PrefillSpec) -> None:
    """What `spec` needs of this machine, checked before any weights are made: the expert backend's devices and
    libraries (FFI: CUDA GPUs and the store's library, else `FfiUnavailable`)."""
    expert_backend(spec.experts_word).check(jax.devices()[:spec.pipeline * spec.ranks], spec.ranks)


def build_driver(spec: PrefillSpec, cfg: FamilyConfig | None = None, *, batch: int | None = None) -> Driver:
    """The driver of `spec` (`cfg`: its config when already read). `batch` (spread specs): the batch the driver will
    run, for its description of the microbatches."""
    cfg = cfg or spec.config()
    dtype = jnp.dtype(spec.dtype)
    mode = execution_mode(spec.mode)
    if spec.spread:
        return _pipeline_driver(spec, cfg, dtype, mode, batch)
    if mode == "scanned":
        scanned, source = _scanned_model(spec, cfg, dtype)
        prefill = jit_prefill_scanned(scanned, logits=spec.logits, cache_len=spec.cache_len)
        return Driver(spec, cfg, _one_device(prefill), prefill.compile, f"{source}, {scanned.describe()}")
    if spec.checkpoint is not None:
        model, report = load_checkpoint(spec.checkpoint, cfg=cfg, dtype=dtype, fused_swiglu=spec.fused_swiglu)
        model = model if spec.kernels is None else with_kernels(model, spec.kernels)
        source = report.line()
    else:
        model = init_model(cfg, dtype=dtype, seed=spec.seed, fused_swiglu=spec.fused_swiglu, kernels=spec.kernels)
        source = "random weights"
    if spec.prefill_chunk is not None:
        run = chunked_prefill(model, spec.logits, spec.prefill_chunk, mode=mode)
        return Driver(spec, cfg, run, run, f"{source}, prefill in pieces of {spec.prefill_chunk} tokens")
    prefill = jit_prefill(model, logits=spec.logits, mode=mode, cache_len=spec.cache_len)
    return Driver(spec, cfg, _one_device(prefill), prefill.compile, source, model=model)


def _pipeline_driver(spec, cfg, dtype, mode, batch) -> Driver:
    backend = expert_backend(spec.experts_word)
    options = dict(dwdp=spec.ranks, dtype=dtype, boundaries=spec.stage_boundaries, fused_swiglu=spec.fused_swiglu,
                   experts=backend, scan=mode == "scanned", kernels=spec.kernels)
    if spec.checkpoint is not None:
        pipe = Pipeline.from_checkpoint(spec.checkpoint, spec.pipeline, cfg=cfg, **options)
    else:
        pipe = Pipeline.random(cfg, spec.pipeline, seed=spec.seed, **options)

    def run(tokens, lengths):
        return pipe.prefill(tokens, lengths, microbatches=spec.microbatches, logits=spec.logits,
                            mode=mode, cache_len=spec.cache_len)

    stages = ", ".join(f"[{s.start_layer},{s.end_layer})" for s in pipe.stages)
    scheme = "dep" if backend.name == "dep" else f"dwdp ({backend.name})" if spec.ranks > 1 else "dwdp"
    text = f"pipeline {spec.pipeline} stages {stages}, {scheme} {spec.ranks} ranks per stage"
    if batch is not None:
        size, used = microbatch_rows(batch, spec.microbatches, spec.ranks)
        pad = size * used - batch
        padding = f" ({pad} padding row{'s' if pad > 1 else ''} of length 0)" if pad else ""
        text += f", {used} microbatches of {size} sequences{padding}"
    text += ", each stage scanned" if mode == "scanned" else ""
    return Driver(spec, cfg, run, run, text, close=pipe.close, reports=pipe.reports)


def _whole_model(spec: PrefillSpec, cfg: FamilyConfig):
    """The spec's whole model on the default device (the weights its drivers build: a checkpoint's, or the preset's
    random weights of `seed`, which depend on the global layer only)."""
    dtype = jnp.dtype(spec.dtype)
    if spec.checkpoint is not None:
        model, _ = load_checkpoint(spec.checkpoint, cfg=cfg, dtype=dtype, fused_swiglu=spec.fused_swiglu)
        return model if spec.kernels is None else with_kernels(model, spec.kernels)
    return init_model(cfg, dtype=dtype, seed=spec.seed, fused_swiglu=spec.fused_swiglu, kernels=spec.kernels)


def last_logits(logits, lengths) -> np.ndarray:
    """Each sequence's last-position logits [B, V] from a prefill's "last" ([B, V]) or "all" ([B, T, V]) logits."""
    logits = np.asarray(logits, np.float32)
    if logits.ndim == 2:
        return logits
    return np.take_along_axis(logits, (np.asarray(lengths) - 1)[:, None, None], axis=1)[:, 0]


def _one_device(prefill):
    """A one-device prefill(tokens, lengths) -> (logits, cache) as a driver's run: (logits, [cache])."""
    def run(tokens, lengths):
        logits, cache = prefill(tokens, lengths)
        return logits, [cache]
    return run


def _scanned_model(spec, cfg, dtype):
    """(the whole model built one layer at a time straight into the scanned layout, where its weights came from):
    `ScannedModel.from_layers`, so the peak is the model plus one layer."""
    if spec.checkpoint is not None:
        loader = CheckpointLayers(spec.checkpoint, cfg, dtype, jax.devices()[0], fused_swiglu=spec.fused_swiglu,
                                  kernels=spec.kernels)
        try:
            scanned = ScannedModel.from_layers(cfg, loader)
        finally:
            loader.close()
        return scanned, loader.report(0, cfg.num_hidden_layers).line()
    return (ScannedModel.random(cfg, dtype=dtype, seed=spec.seed, fused_swiglu=spec.fused_swiglu,
                                kernels=spec.kernels), "random weights")


def chunked_prefill(model, logits: LogitsMode, chunk: int, *, mode: str = DEFAULT_MODE):
    """prefill(tokens, lengths) -> (logits, [cache]) that runs the prompt in pieces of `chunk` tokens, each
    continuing the previous piece's cache: the logits ("all": every position's, the pieces' side by side; "last":
    each sequence's last position, from the piece that holds it) and the cache of one prefill of the whole prompt."""
    programs = {}  # prompt length -> jit_prefill (built once, not on every timed run)

    def run(tokens, lengths):
        t = tokens.shape[1]
        if t not in programs:
            programs[t] = jit_prefill(model, logits=logits, cache_len=t, mode=mode)
        prefill = programs[t]
        cache, parts, last = None, [], None
        for start in range(0, t, chunk):
            n = np.clip(lengths - start, 0, chunk).astype(np.int32)
            out, cache = prefill(tokens[:, start : start + chunk], n, cache=cache)
            if logits == "all":
                parts.append(out)
            elif logits == "last":  # a sequence's last token lies in the last piece that has any of its tokens
                last = out if last is None else jnp.where(jnp.asarray(n > 0)[:, None], out, last)
        return (jnp.concatenate(parts, axis=1) if logits == "all" else last), [cache]

    return run


def run_prefill(spec: PrefillSpec, cfg: FamilyConfig, tokens, lengths, *, iters: int = 3,
                watchdog: Watchdog | None = None, status=None, generate: int = 0, progress=None,
                share_gpu: bool = False) -> dict | None:
    """What `jax-dwdp prefill` runs once `preflight` and `prefill_inputs` have passed: the spec's driver built
    (`status(text)` told "loading ..." or "making random weights") and `measure`d; a float32 spec with every matmul
    at full precision (a reference run), set for the process so that a pipeline's stage threads use it too, and
    restored after. Returns measure's dict, None in a process of a launch that does not report (`Driver.reports`).
    A spec that cannot be built raises SpecError; the library's own errors of its inputs pass as they are.
    `generate` N > 0: also N greedy tokens per sequence continuing the warm-up prefill ("generated" [B, N]; the
    caches get room for them). `progress`: a stream for the loading and building progress lines (jax_dwdp.progress;
    None: none). `share_gpu`: this launch's processes share one GPU (see `measure`)."""
    say = status or (lambda text: None)
    if generate > 0:
        if spec.prefill_chunk is not None:
            raise SpecError("generating continues one prefill's cache: not a prefill in pieces")
        spec = dataclasses.replace(spec, cache_len=tokens.shape[1] + generate - 1)
    precision = jax.config.jax_default_matmul_precision
    if spec.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    try:
        say(f"loading {spec.checkpoint}" if spec.checkpoint is not None else "making random weights")
        try:
            with shown_on(progress):
                built = build_driver(spec, cfg, batch=tokens.shape[0])
        except ValueError as e:
            if isinstance(e, (ConfigError, InputError, CheckpointError, OptionError)):
                raise
            raise SpecError(str(e)) from None  # layout and mesh problems (too many stages, too few devices)
        with built:
            result = measure(built, tokens, lengths, iters=iters, watchdog=watchdog, status=status,
                             share_gpu=share_gpu)
            if not built.reports:
                return None
            if generate > 0:
                say(f"generating {generate} tokens per sequence (the reference decode step)")
                result["generated"] = built.generate(last_logits(result["logits"], lengths), result["caches"],
                                                     generate)
            return result
    finally:
        jax.config.update("jax_default_matmul_precision", precision)


def measure(driver: Driver, tokens, lengths, *, iters: int = 3, watchdog: Watchdog | None = None,
            status=None, share_gpu: bool = False) -> dict:
    """Compiles, runs one warm-up and `iters` timed prefills (the median reported), each step under `watchdog`
    (which ends a step that stalls), `status(text)` told of each phase. Returns the numbers `jax-dwdp prefill`
    reports, with the warm-up's "logits" (whole, on every process of a launch) and "caches" (this process's).
    `share_gpu`: the launch's processes share one GPU, so the logits are gathered through the host
    (`distributed.host_gather`) instead of a device all-gather."""
    step = watchdog.step if watchdog is not None else (lambda what: contextlib.nullcontext())
    say = status or (lambda text: None)
    say("compiling")
    t0 = time.perf_counter()
    with step("compiling"):
        driver.compile(tokens, lengths)
    compile_s = time.perf_counter() - t0
    say(f"running 1 warm-up and {iters} timed prefills")
    with step("running the warm-up prefill"):
        logits, caches = driver.run(tokens, lengths)
        jax.block_until_ready((logits, caches))
    times = []
    for i in range(iters):
        with step(f"running timed prefill {i + 1} of {iters}"):
            t0 = time.perf_counter()
            jax.block_until_ready(driver.run(tokens, lengths))
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    devices = jax.devices()[:driver.spec.pipeline * driver.spec.ranks]
    if jax.process_count() > 1:
        if logits is not None and not logits.is_fully_addressable:  # split over the ranks' processes: all gather
            if share_gpu:  # NCCL, which the device all-gather runs on, refuses two ranks on one GPU
                logits = distributed.host_gather(logits, "logits")
            else:
                from jax.experimental import multihost_utils

                logits = multihost_utils.process_allgather(logits, tiled=True)
        devices = [d for d in devices if d.process_index == jax.process_index()]
        caches = [c for c in caches if c is not None]
    cfg, n_tokens = driver.cfg, int(np.size(tokens))
    positions = n_tokens if driver.spec.logits == "all" else tokens.shape[0]
    flops = cfg.prefill_flops(tokens.shape[0], tokens.shape[1], positions)
    return {
        "model": f"{cfg.summary()}; {driver.description}",
        "platform": jax.devices()[0].platform,
        "device": jax.devices()[0].device_kind,
        "dtype": driver.spec.dtype,
        "batch": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "compile_s": round(compile_s, 3),
        "prefill_s": round(seconds, 5),
        "tokens_per_s": round(n_tokens / seconds, 1),
        "tflops_per_s": round(flops / seconds / 1e12, 2),
        "peak_device_memory_bytes": peak_memory_bytes()[0],
        "peak_device_memory_bytes_per_device": peak_memory_bytes(devices),
        "cache_bytes": int(sum(c.nbytes() for c in caches)),
        "logits": logits,
        "caches": caches,
    }


def peak_memory_bytes(devices=None) -> list[int | None]:
    """XLA's peak bytes in use on each device (default: the first), since the process started; None where the
    platform does not say (CPU). Memory outside XLA's allocator (an FFI expert store) is not in it."""
    return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in (devices or jax.local_devices()[:1])]


def prefill_inputs(spec: PrefillSpec, cfg: FamilyConfig, tokens=None, lengths=None, *, batch: int = 1,
                   seq_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """The checked int32 (tokens, lengths) of a prefill of `spec` (`cfg`: its config): `tokens` [B, T] ids,
    right-padded to `lengths` (default: every row full), or None for `batch` x `seq_len` random ids drawn with the
    spec's seed. Refused (InputError, ValueError), before anything is built: ids outside the vocabulary or lengths
    outside the rows; tokens whose caches, logits and hidden states alone exceed the host's memory (random ids:
    before they are drawn), which would otherwise be a MemoryError or an allocator failure deep in XLA minutes
    later; a layout that cannot take the batch or split the experts over its ranks."""
    if spec.fused_swiglu and not isinstance(cfg, ModelConfig):
        raise SpecError("$fused_swiglu: this model's experts have no SwiGLU to fuse (Nemotron-H's are relu^2)")
    all_logits = spec.logits == "all"
    drawn = tokens is None
    if drawn:
        if batch < 1 or seq_len < 1:
            raise SpecError(f"$batch and $seq_len must be >= 1, got {batch} and {seq_len}")
        check_host_memory(cfg, spec.dtype, batch, seq_len, all_logits=all_logits)
        tokens = random_tokens(cfg.vocab_size, batch, seq_len, spec.seed)
    tokens, lengths = check_tokens(tokens, cfg.vocab_size, lengths)
    if not drawn:
        check_host_memory(cfg, spec.dtype, *tokens.shape, all_logits=all_logits)
    check_layout(tokens.shape[0], spec.microbatches, spec.ranks)
    ExpertLayout(cfg.num_experts, spec.ranks)
    return tokens, lengths


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """int32 [batch, seq_len] ids drawn uniformly from the vocabulary (numpy's default generator of `seed`)."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len)).astype(np.int32)


def read_tokens(path: str | Path) -> np.ndarray:
    """The array of a .npy file of token ids (checked by `prefill_inputs`); an InputError naming the file when it
    is missing, not a regular file, or not one numpy reads as .npy (no pickled objects)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: is not a regular file")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises several types for a file that is not .npy
        raise InputError(f"{path}: not a readable .npy file ({e})") from None


def check_host_memory(cfg: FamilyConfig, dtype, batch: int, seq_len: int, *, all_logits: bool) -> None:
    """An InputError when a prefill's tokens, caches, logits and hidden states alone (`prefill_bytes_lower_bound`)
    exceed this machine's memory (`host_memory_bytes`)."""
    need = prefill_bytes_lower_bound(cfg, dtype, batch, seq_len, all_logits=all_logits)
    have, gib = host_memory_bytes(), 2**30
    if need["total"] > have:
        raise InputError(f"a batch of {batch} x {seq_len} tokens needs at least {need['total'] / gib:.1f} GiB "
                         f"(caches {need['caches'] / gib:.1f}, logits {need['logits'] / gib:.1f}, hidden states "
                         f"{need['hidden'] / gib:.1f}), more than this machine's {have / gib:.1f} GiB")


def prefill_bytes_lower_bound(cfg: FamilyConfig, dtype, batch: int, seq_len: int, *, all_logits: bool) -> dict:
    """What a prefill's tokens, caches, logits and hidden states alone take (a lower bound of what it holds), by
    part: {"caches", "logits", "hidden", "total"} in bytes."""
    whole = plan_stages(cfg, 1)[0]
    dtype = jnp.dtype(dtype)
    cache = batch * (cache_bytes_per_sequence(cfg, whole, dtype) + seq_len * cache_bytes_per_token(cfg, whole, dtype))
    logits = (batch * seq_len if all_logits else batch) * cfg.vocab_size * 4
    hidden = batch * seq_len * cfg.hidden_size * dtype.itemsize
    return {"caches": cache, "logits": logits, "hidden": hidden, "total": batch * seq_len * 4 + cache + logits + hidden}


def host_memory_bytes() -> int:
    """The host's physical memory (CPU devices share it; a GPU's own memory is smaller, and XLA reports that)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def not_finite(logits, caches) -> str | None:
    """What to tell of logits that hold NaN or Inf: how many, and the first layer whose cache does; None when every
    value is finite."""
    values = np.asarray(logits)
    bad = int(values.size - np.isfinite(values).sum())
    if not bad:
        return None
    first = first_non_finite_layer(caches)
    where = (f"; the first layer whose cache holds such values is layer {first}" if first is not None else
             "; every layer's cache is finite, so they arose in the final norm or the head")
    return (f"the logits are not finite ({bad} of {values.size} values NaN or Inf){where}; are the weights finite? "
            "(`jax-dwdp verify` checks a converted checkpoint)")


def first_non_finite_layer(caches) -> int | None:
    """The first layer whose cache holds NaN or Inf (each layer's cache is computed from its input, so values went
    bad in that layer or, through its input, before it); None when every cache is finite."""
    first = None
    for cache in caches:
        if cache is None:
            continue
        for ids, arrays in ((cache.full_layer_ids, (cache.key, cache.value)),
                            (cache.linear_layer_ids, (cache.conv, cache.recurrent))):
            for slot, layer in enumerate(ids):
                if not all(np.isfinite(np.asarray(a[slot])).all() for a in arrays):
                    first = layer if first is None else min(first, layer)
    return first
