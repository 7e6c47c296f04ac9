"""jax-dwdp runs long-context prefill of Qwen3.5-MoE models in JAX: on one device, over pipeline stages, or over DWDP
ranks that split each layer's experts; it converts Hugging Face checkpoints to Orbax and plans layouts.

    jax-dwdp prefill (--checkpoint DIR | --preset NAME) [--tokens FILE.npy | --batch B --seq-len T]
                     [--dtype bfloat16|float32] [--logits-out FILE.npy] [--json]
    jax-dwdp convert HF_DIR OUT_DIR [--dtype bfloat16|float32] [--overwrite] [--json]
    jax-dwdp verify DIR
    jax-dwdp plan (--checkpoint DIR | --preset NAME) [--pipeline P] [--dwdp N | --dep N]

Bad input ends with one line on stderr starting with "error:" and exit status 2 (a device failure: 1; Ctrl-C:
130), never a traceback (pass --debug to see one).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jax_dwdp import distributed
from jax_dwdp.watchdog import Watchdog

DTYPES = ("bfloat16", "float32")
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


DEFAULT_BATCH, DEFAULT_SEQ_LEN = 1, 128
DEFAULT_STALL_S = 1800.0  # the longest step measured, compiling the 40-layer model as one GPU program, takes minutes
MAX_SEED = 2**32 - 1  # jax.random.key and numpy's generators both take it
NATIVE_LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}  # XLA / gRPC: errors only (3 hides fatal ones too)


class UsageError(ValueError):
    """A command line that cannot run; the message says why."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path,
                     help="an HF safetensors folder (with config.json) or a jax_dwdp Orbax checkpoint (convert)")
    src.add_argument("--preset", help="tiny | 35b-a3b | 122b-a10b | 397b-a17b (random weights)")
    p.add_argument("--num-layers", type=int, help="keep only the first N layers (of a checkpoint: load only those)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--seed", type=int, default=0, help=f"seed of random weights and random tokens, in [0, {MAX_SEED}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-dwdp", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[2])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--verbose", action="store_true",
                        help="let the native libraries' own log lines through (XLA, gRPC, gloo; hidden by default)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="run a jit-compiled prefill and report its speed")
    _add_model_args(p)
    p.add_argument("--tokens", type=Path, help="int32 [B, T] .npy of token ids")
    p.add_argument("--batch", type=int, help="random tokens: sequences (default 1)")
    p.add_argument("--seq-len", type=int, help="random tokens: length (default 128)")
    p.add_argument("--logits-out", metavar="FILE",
                   help="write float32 [B, T, V] logits of all positions to this regular file (a symlink: to its "
                        "target), atomically")
    p.add_argument("--iters", type=int, default=3, help="timed runs after the warm-up (default 3)")
    p.add_argument("--pipeline", type=int, default=1, help="pipeline stages (one mesh row each)")
    p.add_argument("--dwdp", type=int, default=1, help="DWDP ranks per stage (experts split over them)")
    p.add_argument("--dwdp-backend",
                   help="with --dwdp N > 1: xla (all-gather, every platform), ffi (CUDA VMM store, GPUs) or local "
                        "(every rank holds all experts: the replicated baseline)")
    p.add_argument("--dep", type=int, default=1,
                   help="DEP ranks per stage: experts split over them, tokens sent to their experts and back "
                        "(instead of --dwdp)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches pushed through the pipeline")
    p.add_argument("--stage-boundaries", help="first layers of stages 1.., comma separated (default: even split)")
    p.add_argument("--layerwise", action="store_true",
                   help="compile one program per layer type instead of the whole model (fast compile for deep models)")
    p.add_argument("--scan", action="store_true",
                   help="the layer stack (of the model, or of each --pipeline stage) as one scanned program over "
                        "stacked weights (compile time independent of depth, one dispatch per prefill or per stage "
                        "and microbatch)")
    p.add_argument("--prefill-chunk", type=int, metavar="C",
                   help="prefill the prompt in pieces of C tokens, each continuing the previous piece's cache "
                        "(chunked prefill; one device)")
    p.add_argument("--fused-swiglu", action="store_true",
                   help="expert gate_up weights interleaved for the fused SwiGLU GPU kernel (opt-in: measured at parity)")
    p.add_argument("--num-processes", type=int, default=1, metavar="N",
                   help="one process per device: start N local processes (or, with --coordinator and --process-id, "
                        "join a launch of N made by another tool); N must equal the devices the layout uses")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="the jax.distributed coordinator of an outside launch")
    p.add_argument("--process-id", type=int, metavar="I", help="this process's index in an outside launch")
    p.add_argument("--process-timeout", type=int, default=60, metavar="S",
                   help="seconds to wait for the other processes to start, and for a silent peer before it counts "
                        "as dead (default 60)")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_S, metavar="S",
                   help=f"end the run, naming the step, when one step (compiling, a prefill) goes S seconds without "
                        f"finishing (default {DEFAULT_STALL_S:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-verify", action="store_true",
                   help="Orbax checkpoint: skip checking its files against the checksums convert wrote")
    c = sub.add_parser("convert", help="convert an HF safetensors folder to a jax_dwdp Orbax checkpoint")
    c.add_argument("hf_dir", type=Path, metavar="HF_DIR",
                   help="HF folder: config.json and model.safetensors, or shards with model.safetensors.index.json")
    c.add_argument("out_dir", type=Path, metavar="OUT_DIR",
                   help="the Orbax checkpoint to write (not inside HF_DIR); locked while converting")
    c.add_argument("--dtype", help="cast every tensor to bfloat16 or float32 (default: keep each tensor's dtype)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR that is a jax_dwdp checkpoint or an empty folder (only once the new "
                        "one is complete)")
    c.add_argument("--json", action="store_true", help="print the summary as one JSON object (no progress bar)")
    v = sub.add_parser("verify", help="check every file of a converted checkpoint against its checksum")
    v.add_argument("directory", type=Path, metavar="DIR", help="a jax_dwdp Orbax checkpoint made by convert")
    v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    q = sub.add_parser("plan", help="print the stage layout: layers, weights and caches per stage, memory per rank")
    _add_model_args(q)
    q.add_argument("--pipeline", type=int, default=1, help="pipeline stages (default 1)")
    q.add_argument("--dwdp", type=int, default=1, help="DWDP ranks per stage (default 1)")
    q.add_argument("--dep", type=int, default=1, help="DEP ranks per stage (default 1; instead of --dwdp)")
    q.add_argument("--stage-boundaries", help="first layers of stages 1.., comma separated")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def _boundaries(args) -> list[int] | None:
    if not args.stage_boundaries:
        return None
    if args.pipeline == 1:
        raise UsageError("--stage-boundaries needs --pipeline P with P >= 2 stages")
    try:
        return [int(x) for x in args.stage_boundaries.split(",")]
    except ValueError:
        raise UsageError(f"--stage-boundaries {args.stage_boundaries!r}: expected comma-separated layer ids") from None


def _model_config(args):
    from jax_dwdp.config import ModelConfig

    if args.checkpoint is not None:
        from jax_dwdp.weights.hf_loader import load_config

        _need(args.checkpoint, True, "--checkpoint")
        cfg = load_config(args.checkpoint)
    else:
        cfg = ModelConfig.preset(args.preset)
    if args.num_layers is not None:
        if not 1 <= args.num_layers <= cfg.num_hidden_layers:
            raise UsageError(f"--num-layers must lie in [1, {cfg.num_hidden_layers}], got {args.num_layers}")
        cfg = cfg.first_layers(args.num_layers)
    return cfg


def _need(path: Path, folder: bool, flag: str = "") -> None:
    """`path` exists and is a folder (folder=True) or a regular file; else one line saying which it is not."""
    named, kind = f"{flag} {path}".strip(), "folder" if folder else "file"
    if not path.exists():
        raise UsageError(f"{named}: no such {kind}")
    if not (path.is_dir() if folder else path.is_file()):
        raise UsageError(f"{named}: is not a {'folder' if folder else 'regular file'}")


def _dtype(name: str):
    import jax.numpy as jnp

    if name not in DTYPES:
        raise UsageError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return jnp.dtype(name)


def _load_tokens(args, vocab_size: int):
    if args.tokens is not None:
        _need(args.tokens, False, "--tokens")
        try:
            tokens = np.load(args.tokens, allow_pickle=False)
        except Exception as e:  # numpy raises several types for a file that is not .npy
            raise UsageError(f"--tokens {args.tokens}: not a readable .npy file ({e})") from None
        return tokens
    rng = np.random.default_rng(args.seed)
    return rng.integers(0, vocab_size, (args.batch, args.seq_len)).astype(np.int32)


def _token_shape(args) -> None:
    """--batch / --seq-len: random tokens only (a --tokens file has its own shape); defaults filled in."""
    if args.tokens is not None:
        given = [flag for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len)) if value is not None]
        if given:
            verb = "shape" if len(given) > 1 else "shapes"
            raise UsageError(f"{' and '.join(given)} {verb} random tokens; with --tokens the file gives the shape")
        return
    args.batch = DEFAULT_BATCH if args.batch is None else args.batch
    args.seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    if args.batch < 1 or args.seq_len < 1:
        raise UsageError(f"--batch and --seq-len must be >= 1, got {args.batch} and {args.seq_len}")


def _check_size(args, cfg, dtype, batch: int, seq_len: int) -> None:
    """Refuses a prefill whose tokens, caches and logits alone (a lower bound of what it holds) exceed the memory of
    this machine, before anything is allocated: otherwise numpy's MemoryError, or an allocator failure deep in XLA
    minutes later."""
    from jax_dwdp.parallel.pipeline import cache_bytes_per_sequence, cache_bytes_per_token, plan_stages

    whole = plan_stages(cfg, 1)[0]
    itemsize = dtype.itemsize
    cache = batch * (cache_bytes_per_sequence(cfg, whole, dtype) + seq_len * cache_bytes_per_token(cfg, whole, dtype))
    positions = batch * seq_len if args.logits_out is not None else batch
    logits = positions * cfg.vocab_size * 4
    hidden = batch * seq_len * cfg.hidden_size * itemsize
    need = batch * seq_len * 4 + cache + logits + hidden
    have = _memory_bytes()
    if need > have:
        raise UsageError(f"--batch {batch} x {seq_len} tokens needs at least {need / 2**30:.1f} GiB (caches "
                         f"{cache / 2**30:.1f}, logits {logits / 2**30:.1f}, hidden states {hidden / 2**30:.1f}), "
                         f"more than this machine's {have / 2**30:.1f} GiB")


def _memory_bytes() -> int:
    """The host's physical memory (CPU devices share it; a GPU's own memory is smaller, and XLA reports that)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_options(args) -> None:
    """The prefill options on their own (no device, no weights): checked by the launcher of a multi-process run
    before it starts any process, and by every single-process run."""
    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if min(args.pipeline, args.microbatches, args.dwdp, args.dep) < 1:
        raise UsageError("--pipeline, --dwdp, --dep and --microbatches must be >= 1")
    if args.prefill_chunk is not None:
        if args.prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
        if max(args.pipeline, args.microbatches, _ranks(args)) > 1:
            raise UsageError("--prefill-chunk runs on one device: it does not combine with --pipeline, --dwdp, --dep "
                             "or --microbatches")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must lie in [0, {MAX_SEED}], got {args.seed}")
    if not args.stall_timeout > 0:
        raise UsageError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    if args.dwdp_backend is not None:
        if args.dwdp_backend not in ("xla", "ffi", "local"):
            raise UsageError(f"--dwdp-backend {args.dwdp_backend!r}: choose xla or ffi (DWDP), or local (every rank "
                             "holds all experts)")
        if args.dep > 1:
            raise UsageError(f"--dwdp-backend {args.dwdp_backend} is for --dwdp; --dep has one way to move tokens")
        if args.dwdp < 2:
            raise UsageError(f"--dwdp-backend {args.dwdp_backend} needs --dwdp N with N >= 2 ranks (it chooses how "
                             "they get their experts)")
    if args.scan and (_ranks(args) > 1 or args.layerwise or args.prefill_chunk is not None):
        raise UsageError("--scan runs the model (or each --pipeline stage) on one device as one program: it does not "
                         "combine with --dwdp, --dep (their experts move between layers), --layerwise or "
                         "--prefill-chunk")


def _check_layout(args, cfg, batch: int) -> None:
    """The layout against the batch and the experts, before any weights are made."""
    from jax_dwdp.parallel.expert_layout import ExpertLayout
    from jax_dwdp.parallel.pipeline import check_layout

    try:
        check_layout(batch, args.microbatches, _ranks(args))
        ExpertLayout(cfg.num_experts, _ranks(args))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _build_runner(args, cfg, dtype, mode, batch, resources):
    """Returns (prefill(tokens, lengths) -> (logits, caches), compile(tokens, lengths), description); what it opens
    (an FFI pipeline's expert stores) is entered into `resources` (an ExitStack), which closes it."""
    from jax_dwdp.prefill import jit_prefill

    ranks = _ranks(args)  # (the options were checked by cmd_prefill)
    if _backend(args) == "ffi":
        import jax

        from jax_dwdp.parallel.dwdp_ffi import FfiUnavailable, load_library, require_gpus

        try:  # before any weights are made: no GPU, no driver or no library is a one-line error
            require_gpus(jax.devices())
            load_library()
        except FfiUnavailable as e:
            raise UsageError(f"--dwdp-backend ffi: {e}") from None
    _check_layout(args, cfg, batch)
    boundaries = _boundaries(args)
    _status(args, f"loading {args.checkpoint}" if args.checkpoint is not None else "making random weights")
    if args.pipeline > 1 or args.microbatches > 1 or ranks > 1:
        from jax_dwdp.parallel import Pipeline
        from jax_dwdp.parallel.pipeline import microbatch_rows

        experts = "dep" if args.dep > 1 else _backend(args) if args.dwdp > 1 else "local"
        try:
            if args.checkpoint is not None:
                pipe = Pipeline.from_checkpoint(args.checkpoint, args.pipeline, dwdp=ranks, dtype=dtype, cfg=cfg,
                                                boundaries=boundaries, fused_swiglu=args.fused_swiglu, experts=experts,
                                                scan=args.scan)
            else:
                pipe = Pipeline.random(cfg, args.pipeline, dwdp=ranks, dtype=dtype, seed=args.seed,
                                       boundaries=boundaries, fused_swiglu=args.fused_swiglu, experts=experts,
                                       scan=args.scan)
        except ValueError as e:  # layout and mesh problems (too many stages, too few devices)
            raise UsageError(str(e)) from None
        resources.enter_context(pipe)
        args.reporter = pipe.reports  # one process per device: the last stage's (first) process reports

        def run(tokens, lengths):
            return pipe.prefill(tokens, lengths, microbatches=args.microbatches, logits=mode, layerwise=args.layerwise)

        stages = ", ".join(f"[{s.start_layer},{s.end_layer})" for s in pipe.stages)
        size, used = microbatch_rows(batch, args.microbatches, ranks)
        pad = size * used - batch
        padding = f" ({pad} padding row{'s' if pad > 1 else ''} of length 0)" if pad else ""
        scheme = "dep" if args.dep > 1 else f"dwdp ({experts})" if args.dwdp > 1 else "dwdp"
        scanned = ", each stage scanned" if args.scan else ""
        return run, run, (f"pipeline {args.pipeline} stages {stages}, {scheme} {ranks} ranks per stage, "
                          f"{used} microbatches of {size} sequences{padding}{scanned}")
    if args.scan:
        from jax_dwdp.scan import jit_prefill_scanned

        scanned, source = _scanned_model(args, cfg, dtype)
        prefill = jit_prefill_scanned(scanned, logits=mode)
        return _one_device(prefill), prefill.compile, f"{source}, {scanned.describe()}"
    if args.checkpoint is not None:
        from jax_dwdp.weights import load_checkpoint

        model, report = load_checkpoint(args.checkpoint, cfg=cfg, dtype=dtype, fused_swiglu=args.fused_swiglu)
        source = report.line()
    else:
        from jax_dwdp.model import init_model

        model, source = init_model(cfg, dtype=dtype, seed=args.seed, fused_swiglu=args.fused_swiglu), "random weights"
    if args.prefill_chunk is not None:
        run = chunked_prefill(model, mode, args.prefill_chunk, args.layerwise)
        return run, run, f"{source}, prefill in pieces of {args.prefill_chunk} tokens"
    prefill = jit_prefill(model, logits=mode, layerwise=args.layerwise)
    return _one_device(prefill), prefill.compile, source


def _one_device(prefill):
    """A one-device prefill(tokens, lengths) -> (logits, cache) as the runner the CLI drives: (logits, [cache])."""
    def run(tokens, lengths):
        logits, cache = prefill(tokens, lengths)
        return logits, [cache]
    return run


def _scanned_model(args, cfg, dtype):
    """(the whole model built one layer at a time straight into the scanned layout, where its weights came from):
    `ScannedModel.from_layers`, so the peak is the model plus one layer."""
    import jax

    from jax_dwdp.scan import ScannedModel

    if args.checkpoint is not None:
        from jax_dwdp.parallel.checkpoint_layers import CheckpointLayers

        loader = CheckpointLayers(args.checkpoint, cfg, dtype, jax.devices()[0], fused_swiglu=args.fused_swiglu)
        try:
            scanned = ScannedModel.from_layers(cfg, loader)
        finally:
            loader.close()
        return scanned, loader.report(0, cfg.num_hidden_layers).line()
    return ScannedModel.random(cfg, dtype=dtype, seed=args.seed, fused_swiglu=args.fused_swiglu), "random weights"


def chunked_prefill(model, mode, chunk: int, layerwise: bool):
    """prefill(tokens, lengths) -> (logits, [cache]) that runs the prompt in pieces of `chunk` tokens, each
    continuing the previous piece's cache: the logits ("all": every position's, the pieces' side by side; "last":
    each sequence's last position, from the piece that holds it) and the cache of one prefill of the whole prompt."""
    import jax.numpy as jnp
    from jax_dwdp.prefill import jit_prefill

    programs = {}  # prompt length -> jit_prefill (built once, not on every timed run)

    def run(tokens, lengths):
        t = tokens.shape[1]
        if t not in programs:
            programs[t] = jit_prefill(model, logits=mode, cache_len=t, layerwise=layerwise)
        prefill = programs[t]
        cache, parts, last = None, [], None
        for start in range(0, t, chunk):
            n = np.clip(lengths - start, 0, chunk).astype(np.int32)
            logits, cache = prefill(tokens[:, start : start + chunk], n, cache=cache)
            if mode == "all":
                parts.append(logits)
            elif mode == "last":  # a sequence's last token lies in the last piece that has any of its tokens
                last = logits if last is None else jnp.where(jnp.asarray(n > 0)[:, None], logits, last)
        return (jnp.concatenate(parts, axis=1) if mode == "all" else last), [cache]

    return run


def _backend(args) -> str:
    """--dwdp-backend, xla when not given."""
    return args.dwdp_backend or "xla"


def _ranks(args) -> int:
    """Ranks per stage: --dwdp N or --dep N (not both)."""
    if args.dwdp > 1 and args.dep > 1:
        raise UsageError(f"--dwdp {args.dwdp} and --dep {args.dep}: choose one way to split the experts")
    return max(args.dwdp, args.dep)


def _peak_memory_bytes(devices=None) -> list[int | None]:
    """XLA's peak bytes in use on each device (default: the first), since the process started; None where the
    platform does not say (CPU). Memory outside XLA's allocator (an FFI expert store) is not in it."""
    import jax

    return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in (devices or jax.local_devices()[:1])]


def _partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def _output_file(raw: str, flag: str) -> Path:
    """The regular file an output option names, checked before any work. A symlink is written through: its target
    is what gets replaced (atomically), the link stays. A device, FIFO, socket or folder is refused, so is a name
    ending in "/" (a folder's name)."""
    if raw.endswith("/"):
        raise UsageError(f"{flag} {raw}: names a folder (it ends with /); give a file name, e.g. {raw}logits.npy")
    path = Path(raw)
    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():
        kind = "a folder" if target.is_dir() else "not a regular file (a device, FIFO or socket)"
        via = f" (the target of the symlink {path})" if target != path else ""
        example = f"; give a file name, e.g. {target / 'logits.npy'}" if target.is_dir() else ""
        raise UsageError(f"{flag} {target}{via}: is {kind}{example}")
    _check_writable(target, flag)
    return target


def _check_writable(path: Path, flag: str) -> None:
    """Before any work: `path` can be written (its folder exists and takes a new file; it is not a folder)."""
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name, e.g. {path / 'logits.npy'}")
    probe = _partial_path(path)
    try:
        probe.open("xb").close()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {path.parent} ({e.strerror})") from None
    probe.unlink()


def _save_npy_atomically(path: Path, array, flag: str) -> None:
    tmp = _partial_path(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except OSError as e:  # checked before the run; this is the file system changing meanwhile (or full)
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e) or type(e).__name__)
        raise UsageError(f"{flag} {path}: cannot write {array.nbytes / 2**20:.1f} MiB ({why}); nothing was "
                         "written") from None
    finally:
        tmp.unlink(missing_ok=True)


def _status(args, text: str) -> None:
    """What a long run is doing, on stderr (stdout keeps the results); quiet with --json."""
    if not args.json and not getattr(args, "quiet", False):
        print(f"{text} ...", file=sys.stderr, flush=True)


def cmd_prefill(args) -> dict:
    import jax

    from jax_dwdp.prefill import check_tokens

    dtype = _dtype(args.dtype)
    _check_options(args)
    _token_shape(args)
    if args.logits_out is not None:
        args.logits_out = _output_file(args.logits_out, "--logits-out")
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    cfg = _model_config(args)
    if args.tokens is None:
        _check_size(args, cfg, dtype, args.batch, args.seq_len)
    if args.checkpoint is not None:
        from jax_dwdp.weights import precision_notice

        notice = precision_notice(args.checkpoint, dtype)
        if notice is not None and not getattr(args, "process_id", None):  # once per launch: process 0 says it
            print(f"notice: {notice}", file=sys.stderr)
    tokens, lengths = check_tokens(_load_tokens(args, cfg.vocab_size), cfg.vocab_size)
    if args.tokens is not None:
        _check_size(args, cfg, dtype, *tokens.shape)
    mode = "all" if args.logits_out is not None else "last"
    from jax_dwdp.weights.orbax_store import checksums_checked

    with contextlib.ExitStack() as resources, checksums_checked(not args.no_verify):
        return _run_prefill(args, cfg, dtype, mode, tokens, lengths, resources)


def _run_prefill(args, cfg, dtype, mode, tokens, lengths, resources) -> dict:
    import jax

    from jax_dwdp.native import build_status

    run, compile_fn, source = _build_runner(args, cfg, dtype, mode, tokens.shape[0], resources)
    devices = jax.devices()[:args.pipeline * _ranks(args)]
    watchdog = Watchdog(args.stall_timeout)

    _status(args, "compiling")
    t0 = time.perf_counter()
    with watchdog.step("compiling"):
        compile_fn(tokens, lengths)
    compile_s = time.perf_counter() - t0
    _status(args, f"running 1 warm-up and {args.iters} timed prefills")
    with watchdog.step("running the warm-up prefill"):
        logits, caches = run(tokens, lengths)
        jax.block_until_ready((logits, caches))
    times = []
    for i in range(args.iters):
        with watchdog.step(f"running timed prefill {i + 1} of {args.iters}"):
            t0 = time.perf_counter()
            jax.block_until_ready(run(tokens, lengths))
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    if jax.process_count() > 1:
        if logits is not None and not logits.is_fully_addressable:  # split over the ranks' processes: all gather
            from jax.experimental import multihost_utils

            logits = multihost_utils.process_allgather(logits, tiled=True)
        devices = [d for d in devices if d.process_index == jax.process_index()]
        caches = [c for c in caches if c is not None]
        if not getattr(args, "reporter", True):
            return {"reporter": False}
    n_tokens = int(tokens.size)
    logits_positions = n_tokens if mode == "all" else tokens.shape[0]
    flops = cfg.prefill_flops(tokens.shape[0], tokens.shape[1], logits_positions)
    finite = bool(np.isfinite(np.asarray(logits)).all())
    if not finite:
        _warn_not_finite(args, logits, caches)
    if args.logits_out is not None:
        _save_npy_atomically(args.logits_out, np.asarray(logits, np.float32), "--logits-out")
    return {
        "command": "prefill",
        "model": f"{cfg.summary()}; {source}",
        "platform": jax.devices()[0].platform,
        "device": jax.devices()[0].device_kind,
        "dtype": args.dtype,
        "batch": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "compile_s": round(compile_s, 3),
        "prefill_s": round(seconds, 5),
        "tokens_per_s": round(n_tokens / seconds, 1),
        "tflops_per_s": round(flops / seconds / 1e12, 2),
        "peak_device_memory_bytes": _peak_memory_bytes()[0],
        "peak_device_memory_bytes_per_device": _peak_memory_bytes(devices),
        "cache_bytes": int(sum(c.nbytes() for c in caches)),
        "logits_out": str(args.logits_out) if args.logits_out else None,
        "logits_finite": finite,
        "ffi_libraries": build_status(),
    }


def _warn_not_finite(args, logits, caches) -> None:
    """One stderr line for logits that hold NaN or Inf: how many, and the first layer whose cache does (each
    layer's cache is computed from its input, so the values went bad in that layer or, through its input, before)."""
    values = np.asarray(logits)
    bad = int(values.size - np.isfinite(values).sum())
    first = None
    for cache in caches:
        if cache is None:
            continue
        for ids, arrays in ((cache.full_layer_ids, (cache.key, cache.value)),
                            (cache.linear_layer_ids, (cache.conv, cache.recurrent))):
            for slot, layer in enumerate(ids):
                if not all(np.isfinite(np.asarray(a[slot])).all() for a in arrays):
                    first = layer if first is None else min(first, layer)
    where = (f"; the first layer whose cache holds such values is layer {first}" if first is not None else
             "; every layer's cache is finite, so they arose in the final norm or the head")
    print(f"warning: the logits are not finite ({bad} of {values.size} values NaN or Inf){where}; are the weights "
          "finite? (`jax-dwdp verify` checks a converted checkpoint)", file=sys.stderr)


def _print_human(result: dict) -> None:
    peak = result.get("peak_device_memory_bytes")
    peak_s = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a on this platform"
    print(f"model: {result['model']}")
    print(f"{result['platform']} ({result['device']}), {result['dtype']}, batch {result['batch']} x {result['seq_len']} tokens")
    print(f"compile: {result['compile_s']:.2f} s; prefill: {result['prefill_s'] * 1e3:.2f} ms")
    print(f"tokens/s: {result['tokens_per_s']:.1f}  ({result['tflops_per_s']} TFLOP/s)")
    per_device = result.get("peak_device_memory_bytes_per_device") or []
    if len(per_device) > 1 and all(p is not None for p in per_device):
        peak_s = ", ".join(f"{p / 2**30:.2f}" for p in per_device) + " GiB (per device)"
    print(f"peak device memory: {peak_s}")
    if result.get("logits_out"):
        print(f"logits written to {result['logits_out']}")
    print(result["ffi_libraries"])


def _print_plan(result: dict) -> None:
    gib = 2**30
    scheme = "DEP" if result["dep"] > 1 else "DWDP"
    ranks = max(result["dwdp"], result["dep"])
    print(f"model: {result['model']}; {result['dtype']}")
    print(f"{result['pipeline']} stage(s) x {ranks} {scheme} rank(s)")
    print("| stage | layers | full-attn layers | weights GiB | KV cache per token | state per sequence MiB | device "
          "| experts | resident GiB | buffers GiB | peer GiB per layer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for st in result["stages"]:
        for r in st["dwdp_ranks"]:
            buffers = r["prefetch_buffer_bytes"] if scheme == "DWDP" else 0
            print(f"| {st['stage']} | [{st['start_layer']}, {st['end_layer']}) | {len(st['full_attention_layers'])} "
                  f"| {st['weight_bytes'] / gib:.2f} | {st['cache_bytes_per_token'] / 1024:.1f} KiB "
                  f"| {st['cache_bytes_per_sequence'] / 2**20:.1f} | {r['device']} "
                  f"| [{r['experts_owned'][0]}, {r['experts_owned'][1]}) | {r['resident_bytes'] / gib:.2f} "
                  f"| {buffers / gib:.2f} | {r['peer_bytes_per_layer'] / gib:.3f} |")
    if scheme == "DWDP" and ranks > 1:
        print("buffers: two layers' full expert sets for the FFI store's prefetch (the XLA all-gather's, with padding "
              "slots, in --json as xla_gather_buffer_bytes)")


def cmd_plan(args) -> dict:
    dtype = _dtype(args.dtype)
    cfg = _model_config(args)
    if min(args.dwdp, args.dep) < 1:
        raise UsageError(f"--dwdp and --dep must be >= 1, got {args.dwdp} and {args.dep}")
    try:
        stages = plan_layout(cfg, args.pipeline, _ranks(args), dtype, boundaries=_boundaries(args), dep=args.dep > 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return {"command": "plan", "model": cfg.summary(), "dtype": args.dtype, "pipeline": args.pipeline,
            "dwdp": args.dwdp, "dep": args.dep, "stages": stages}


def plan_layout(cfg, pipeline: int, ranks: int, dtype, *, boundaries=None, dep: bool = False) -> list[dict]:
    """What `jax-dwdp plan` prints per stage: layers, weight and cache bytes, and per rank its experts, resident
    bytes (non-expert weights + its expert block) and buffers (dep=True: none, the experts never move)."""
    import jax.numpy as jnp

    from jax_dwdp.parallel.expert_layout import ExpertLayout, expert_bytes_per_layer, rank_memory
    from jax_dwdp.parallel.pipeline import (cache_bytes_per_sequence, cache_bytes_per_token, plan_stages,
                                            stage_weight_bytes)

    stages = plan_stages(cfg, pipeline, boundaries)
    layout = ExpertLayout(cfg.num_experts, ranks)
    itemsize = jnp.dtype(dtype).itemsize
    out = []
    for st in stages:
        moe_layers = st.end_layer - st.start_layer  # every layer is MoE
        weights = stage_weight_bytes(cfg, st, dtype)
        non_expert = weights - moe_layers * cfg.num_experts * expert_bytes_per_layer(cfg, itemsize)
        # One rank holds every expert: nothing is fetched, so there are no prefetch or gather buffers.
        rank_rows = [dict(rank_memory(cfg, layout, r, moe_layers, itemsize, prefetch=not dep and ranks > 1,
                                      non_expert_bytes=non_expert), device=st.stage * ranks + r)
                     for r in range(ranks)]
        out.append({
            "stage": st.stage,
            "start_layer": st.start_layer,
            "end_layer": st.end_layer,
            "linear_attention_layers": list(st.linear_attention_layers),
            "full_attention_layers": list(st.full_attention_layers),
            "weight_bytes": weights,
            "non_expert_weight_bytes": non_expert,
            "cache_bytes_per_token": cache_bytes_per_token(cfg, st, dtype),
            "cache_bytes_per_sequence": cache_bytes_per_sequence(cfg, st, dtype),
            # Positions in jax.devices() order: row `stage` of the (pipeline, dwdp) mesh.
            "devices": list(range(st.stage * ranks, (st.stage + 1) * ranks)),
            "dwdp_ranks": rank_rows,
        })
    return out


def cmd_convert(args) -> dict:
    from jax_dwdp.weights.orbax_store import convert_hf_to_orbax

    dtype = None if args.dtype is None else _dtype(args.dtype)
    _need(args.hf_dir, True)
    summary = convert_hf_to_orbax(args.hf_dir, args.out_dir, dtype=dtype, overwrite=args.overwrite,
                                  progress=None if args.json else "stderr")
    return {"command": "convert", **summary}


def cmd_verify(args) -> dict:
    from jax_dwdp.weights.orbax_store import verify_checkpoint

    _need(args.directory, True)
    return {"command": "verify", **verify_checkpoint(args.directory)}


COMMANDS = {"prefill": cmd_prefill, "plan": cmd_plan, "convert": cmd_convert, "verify": cmd_verify}


def _ensure_cpu_devices(args) -> None:
    """A CPU-only run of P stages x N ranks needs P x N host devices, which XLA creates only if told before jax
    starts; the flag is ignored by GPU backends."""
    need = getattr(args, "pipeline", 1) * max(getattr(args, "dwdp", 1), getattr(args, "dep", 1))
    flags = os.environ.get("XLA_FLAGS", "")
    if need > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()


def _check_processes(args) -> None:
    """--num-processes / --coordinator / --process-id: a consistent set, and one device per process."""
    n = args.num_processes
    joined = args.coordinator is not None or args.process_id is not None
    if n < 1:
        raise UsageError(f"--num-processes must be >= 1, got {n}")
    if not args.process_timeout > 0:
        raise UsageError(f"--process-timeout must be > 0 seconds, got {args.process_timeout}")
    if args.coordinator is not None:
        _check_address(args.coordinator)
    if joined and (args.coordinator is None or args.process_id is None or n < 2):
        raise UsageError("joining a launch needs --coordinator HOST:PORT, --process-id I and --num-processes N "
                         "(N >= 2)")
    if joined and not 0 <= args.process_id < n:
        raise UsageError(f"--process-id must lie in [0, {n}), got {args.process_id}")
    if n == 1:
        return
    devices = args.pipeline * _ranks(args)
    if devices != n:
        raise UsageError(f"--num-processes {n}: one process per device, but the layout (--pipeline {args.pipeline} x "
                         f"{_ranks(args)} ranks) uses {devices} device(s)")
    if args.pipeline > 1 and _ranks(args) > 1:
        raise UsageError("across processes, --pipeline runs one device per stage and --dwdp / --dep ranks one stage: "
                         "not both yet")
    if args.dwdp > 1 and _backend(args) == "ffi" and not joined:
        from jax_dwdp.distributed import visible_gpus

        if not visible_gpus():  # (a joined process finds out from its own devices, in _build_runner)
            raise UsageError("--dwdp-backend ffi across processes needs a CUDA GPU per process; none is visible "
                             "(use --dwdp-backend xla)")
    if args.prefill_chunk is not None:
        raise UsageError("--prefill-chunk runs on one device, in one process")


def _check_address(address: str) -> None:
    """--coordinator HOST:PORT (an IPv6 host in brackets), checked before jax.distributed sees it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise UsageError(f"--coordinator {address!r}: expected HOST:PORT, e.g. 10.0.0.1:1234 or [::1]:1234")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--coordinator {address!r}: the port {port!r} is not a number in [1, 65535]")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise UsageError(f"--coordinator {address!r}: write an IPv6 host in brackets, e.g. [::1]:{port}")


def _preflight(args) -> None:
    """The launcher's checks of a multi-process prefill before it starts any process: the process and prefill
    options, the dtype, the model's config, the output path, the tokens and the layout against them (no device is
    touched)."""
    from jax_dwdp.prefill import check_tokens

    _check_options(args)
    _token_shape(args)
    dtype = _dtype(args.dtype)
    cfg = _model_config(args)
    if args.logits_out is not None:
        _output_file(args.logits_out, "--logits-out")
    if args.tokens is None:
        _check_size(args, cfg, dtype, args.batch, args.seq_len)
    tokens, _ = check_tokens(_load_tokens(args, cfg.vocab_size), cfg.vocab_size)
    _check_layout(args, cfg, tokens.shape[0])


def main(argv: list[str] | None = None) -> int:
    distributed.die_with_parent()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    quiet_native_logs(args.verbose)
    if args.command == "prefill":
        launcher = args.num_processes > 1 and args.process_id is None
        try:
            _check_processes(args)
            if launcher:
                _preflight(args)
        except Exception as e:  # bad input: one line here, not one per process
            if args.debug or type(e).__name__ not in ("UsageError", "ConfigError", "InputError", "CheckpointError"):
                raise
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if launcher:
            return distributed.launch(argv, args.num_processes, timeout_s=args.process_timeout, verbose=args.verbose,
                                      status=lambda text: print(text, file=sys.stderr, flush=True))
        if args.process_id is not None and not os.environ.get(distributed.SUPERVISED_ENV):
            return distributed.supervise(argv, process_id=args.process_id, num_processes=args.num_processes,
                                         coordinator=args.coordinator, timeout_s=args.process_timeout,
                                         verbose=args.verbose)
    try:
        return _main(args)
    except KeyboardInterrupt:  # what was being written is already removed (e.g. a conversion's partial folder)
        if args.debug:
            raise
        print(f"error: interrupted; {args.command} stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def quiet_native_logs(verbose: bool) -> None:
    """Keeps XLA's and gRPC's own log lines (below fatal) off stderr unless --verbose, where the user has not chosen
    a level; must run before jax starts (the entry script calls it before importing jax)."""
    if not verbose:
        for name, value in NATIVE_LOG_ENV.items():
            os.environ.setdefault(name, value)


def _main(args) -> int:
    if getattr(args, "process_id", None) is not None:  # (the process options were checked by main)
        from jax_dwdp.distributed import initialize

        # Native libraries print to file descriptor 1 (gloo: "Rank i is connected ..."): point it at stderr and keep
        # stdout, through a duplicate, for the results (--json stays one JSON object).
        sys.stdout.flush()
        results = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(results, "w", buffering=1)
        initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.process_timeout)
        args.quiet = args.process_id != 0  # process 0 reports progress
    else:
        _ensure_cpu_devices(args)
    from jax_dwdp.config import ConfigError
    from jax_dwdp.prefill import InputError
    from jax_dwdp.weights.safetensors_reader import CheckpointError

    try:
        result = COMMANDS[args.command](args)
    except (UsageError, ConfigError, InputError, CheckpointError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # a device or XLA failure: one line, the first of its message
        if args.debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {first} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_RUNTIME
    if not result.pop("reporter", True):  # another process of the launch reports
        return 0
    if args.json:
        print(json.dumps(result))
    elif args.command == "plan":
        _print_plan(result)
    elif args.command == "verify":
        print(f"ok: {result['directory']}: {result['files']} files ({result['bytes'] / 1e9:.3f} GB) match their "
              f"checksums and {result['tensors']} tensors hold no NaN or Inf ({result['seconds']:.2f} s)")
    elif args.command == "convert":
        from jax_dwdp.weights.hf_loader import cast_line

        stored = ", ".join(f"{n} {name}" for name, n in sorted(result["dtypes"].items()))
        print(f"converted {result['tensors']} tensors ({result['bytes'] / 1e9:.3f} GB, {result['layers']} layers) "
              f"to {result['output']} in {result['seconds']:.2f} s ({result['gb_per_s']:.3f} GB/s); stored {stored}; "
              f"{cast_line(result['cast'])}; skipped {result['skipped_non_text']} vision/MTP tensors; "
              f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB")
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
