"""jax-dwdp runs long-context prefill of Qwen3.5-MoE and Nemotron-H models in JAX: on one device, over pipeline
stages, or over DWDP ranks that split each layer's experts; it converts Hugging Face checkpoints to Orbax and plans
layouts.

    jax-dwdp prefill (--checkpoint DIR | --preset NAME) [--tokens FILE.npy | --batch B --seq-len T]
                     [--dtype bfloat16|float32] [--logits-out FILE.npy] [--json]
    jax-dwdp convert HF_DIR OUT_DIR [--dtype bfloat16|float32] [--overwrite] [--json]
    jax-dwdp verify DIR
    jax-dwdp plan (--checkpoint DIR | --preset NAME) [--pipeline P] [--dwdp N | --dep N]
                  [--profile h200|h100|FILE [--link NAME|FILE] [--stream SPEC] [--requests K]]

Bad input ends with one line on stderr starting with "error:" and exit status 2 (a device failure: 1; Ctrl-C:
130), never a traceback (pass --debug to see one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from jax_dwdp import distributed
from jax_dwdp.options import MAX_SEED, OptionError, check_dtype
from jax_dwdp.watchdog import Watchdog

EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
DEFAULT_STALL_S = 1800.0  # the longest step measured, compiling the 40-layer model as one GPU program, takes minutes
# Bad input besides OptionError (the spec's and the planner's), by name: the library's modules load late.
BAD_INPUT = ("UsageError", "ConfigError", "InputError", "CheckpointError", "OutputError", "TextError")


class UsageError(ValueError):
    """A command line that cannot run; the message says why."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and the layout: the options prefill and plan share, the fields of a PrefillSpec."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path,
                     help="an HF safetensors folder (with config.json) or a jax_dwdp Orbax checkpoint (convert)")
    src.add_argument("--preset", help="random weights of a preset: FAMILY:NAME, qwen3.5:{tiny,35b-a3b,122b-a10b,"
                     "397b-a17b} (the bare names are these) or nemotron-h:{tiny,nano-30b-a3b,super-120b-a12b}")
    a = p.add_argument
    a("--num-layers", type=int, help="keep only the first N layers (of a checkpoint: load only those)")
    a("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    a("--seed", type=int, default=0, help=f"seed of random weights and random tokens, in [0, {MAX_SEED}]")
    a("--pipeline", type=int, default=1, help="pipeline stages, one mesh row each (default 1)")
    a("--dwdp", type=int, default=1, help="DWDP ranks per stage: each layer's experts split over them (default 1)")
    a("--dep", type=int, default=1, help="DEP ranks per stage, instead of --dwdp: experts split over them, tokens "
      "sent to their experts and back (default 1)")
    a("--stage-boundaries", help="first layers of stages 1.., comma separated (default: even split)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-dwdp", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[2])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--verbose", action="store_true",
                        help="let the native libraries' own log lines through (XLA, gRPC, gloo; hidden by default)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="run a jit-compiled prefill and report its speed")
    _add_model_args(p)
    a = p.add_argument
    a("--tokens", type=Path, help="int32 [B, T] .npy of token ids")
    a("--batch", type=int, help="random tokens: sequences (default 1)")
    a("--seq-len", type=int, help="random tokens: length (default 128)")
    a("--logits-out", metavar="FILE", help="write float32 [B, T, V] logits of all positions to this regular file (a "
      "symlink: to its target), atomically")
    a("--iters", type=int, default=3, help="timed runs after the warm-up (default 3)")
    a("--experts", "--dwdp-backend", dest="experts", metavar="BACKEND", help="how the --dwdp N ranks get their "
      "experts: xla (all-gather, every platform; the default), ffi (CUDA VMM store, GPUs), local (every rank holds "
      "all experts: the replicated baseline) or dep (tokens sent to the experts, as --dep N)")
    a("--microbatches", type=int, default=1, help="microbatches pushed through the pipeline")
    a("--layerwise", action="store_true",
      help="compile one program per layer type instead of the whole model (fast compile for deep models)")
    a("--scan", action="store_true", help="the layer stack (of the model, or of each --pipeline stage) as one scanned "
      "program over stacked weights (compile time independent of depth, one dispatch per prefill or per stage and "
      "microbatch)")
    a("--prefill-chunk", type=int, metavar="C", help="prefill the prompt in pieces of C tokens, each continuing the "
      "previous piece's cache (chunked prefill; one device)")
    a("--fused-swiglu", action="store_true",
      help="expert gate_up weights interleaved for the fused SwiGLU GPU kernel (opt-in: measured at parity)")
    a("--num-processes", type=int, default=1, metavar="N", help="one process per device: start N local processes "
      "(or, with --coordinator and --process-id, join a launch of N made by another tool); N must equal the devices "
      "the layout uses")
    a("--share-gpu", action="store_true", help="with --num-processes and --experts ffi: every process on the first "
      "GPU, a rehearsal of a multi-GPU launch on one GPU (the store's export, descriptor exchange, mapping, copy "
      "stream and layer loop all run; only the link hop does not)")
    a("--coordinator", metavar="HOST:PORT", help="the jax.distributed coordinator of an outside launch")
    a("--process-id", type=int, metavar="I", help="this process's index in an outside launch")
    a("--process-timeout", type=int, default=60, metavar="S", help="seconds to wait for the other processes to "
      "start, and for a silent peer before it counts as dead (default 60)")
    a("--stall-timeout", type=float, default=DEFAULT_STALL_S, metavar="S", help="end the run, naming the step, when "
      f"one step (compiling, a prefill) goes S seconds without finishing (default {DEFAULT_STALL_S:g})")
    a("--json", action="store_true", help="print one JSON object")
    a("--no-verify", action="store_true",
      help="Orbax checkpoint: skip checking its files against the checksums convert wrote")
    t = p.add_argument_group("text in, text out (a --checkpoint with its tokenizer.json)").add_argument
    t("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch of prompts of any lengths)")
    t("--prompt-file", type=Path, metavar="FILE", help="prompts, one per line, or a JSON list of strings")
    t("--chat", action="store_true", help="each prompt as a user turn of the checkpoint's chat template")
    t("--top-k", type=int, default=5, metavar="K", help="the K most likely next tokens of each prompt (default 5)")
    t("--generate", type=int, default=0, metavar="N", help="N greedy tokens continuing each sequence, with the "
      "model's reference decode step on one device (correctness, not speed)")
    c = sub.add_parser("convert", help="convert an HF safetensors folder to a jax_dwdp Orbax checkpoint").add_argument
    c("hf_dir", type=Path, metavar="HF_DIR",
      help="HF folder: config.json and model.safetensors, or shards with model.safetensors.index.json")
    c("out_dir", type=Path, metavar="OUT_DIR",
      help="the Orbax checkpoint to write (not inside HF_DIR); locked while converting")
    c("--dtype", help="cast every tensor to bfloat16 or float32 (default: keep each tensor's dtype)")
    c("--overwrite", action="store_true", help="replace an existing OUT_DIR that is a jax_dwdp checkpoint or an empty "
      "folder (only once the new one is complete)")
    c("--json", action="store_true", help="print the summary as one JSON object (no progress bar)")
    v = sub.add_parser("verify", help="check every file of a converted checkpoint against its checksum").add_argument
    v("directory", type=Path, metavar="DIR", help="a jax_dwdp Orbax checkpoint made by convert")
    v("--json", action="store_true", help="print the result as one JSON object")
    q = sub.add_parser("plan", help="print the stage layout: layers, weights and caches per stage, memory per rank")
    _add_model_args(q)
    q.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    m = q.add_argument_group("performance model (DWDP vs DEP vs replicated weights; a prediction, not a "
                             "measurement)").add_argument
    m("--profile", metavar="NAME|FILE", help="a GPU profile: h200 or h100 (committed, from benchmarks/RESULTS.md) or a "
      "JSON file written by benchmarks/profile_gpu.py; predicts each scheme's time and tokens/s per GPU")
    m("--link", metavar="NAME|FILE", help="the link between the GPUs: profile (default: the profile's own), nvlink4, "
      "nvlink5 (spec sheet, derated as measured on two H200s) or a JSON file")
    m("--stream", metavar="SPEC", help="prompt lengths: TOKENS (every prompt; default 16384), normal:MEAN,STD[,LO,HI] "
      "(clipped, default [MEAN/8, 2*MEAN]) or file:PATH (integers, or a JSON list)")
    m("--requests", type=int, metavar="K", help="requests per rank drawn from the stream (default 8; a file gives its "
      "own)")
    m("--stream-seed", type=int, metavar="S", help="seed of the stream's lengths (default 0)")
    m("--bucket", type=int, metavar="T",
      help="prompts are computed padded to a multiple of T tokens (default 256; real tokens count)")
    m("--dep-exchange", choices=("gather", "routed"), help="DEP's token exchange: gather (jax_dwdp's: every token to "
      "every rank; default) or routed (each token to the ranks of its experts, as a dispatch kernel sends)")
    return parser


def _ranks(args) -> int:
    """Ranks per stage: --dwdp N or --dep N (not both)."""
    if min(args.dwdp, args.dep) < 1:
        raise UsageError(f"--dwdp and --dep must be >= 1, got {args.dwdp} and {args.dep}")
    if args.dwdp > 1 and args.dep > 1:
        raise UsageError(f"--dwdp {args.dwdp} and --dep {args.dep}: choose one way to split the experts")
    return max(args.dwdp, args.dep)


def _experts(args) -> str | None:
    return "dep" if args.dep > 1 else args.experts if args.dwdp > 1 else None


def _flag(args):
    """How this command line spells an option that an OptionError names: its flag (the ranks per stage: the one of
    --dwdp / --dep given)."""
    return lambda name: ("--dep" if args.dep > 1 else "--dwdp") if name == "ranks" else "--" + name.replace("_", "-")


def _spec(args, **extra):
    """The library's PrefillSpec of a prefill (or plan) command line, and the model's config it names; the spec
    checks its own fields (driver.SpecError)."""
    from jax_dwdp.driver import PrefillSpec

    if args.checkpoint is not None:
        _need(args.checkpoint, True, "--checkpoint")
    scan, layerwise = getattr(args, "scan", False), getattr(args, "layerwise", False)
    if scan and layerwise:
        raise UsageError("--scan and --layerwise are two execution modes: choose one")
    try:
        boundaries = tuple(int(x) for x in args.stage_boundaries.split(",")) if args.stage_boundaries else None
    except ValueError:
        raise UsageError(f"--stage-boundaries {args.stage_boundaries!r}: expected comma-separated layer ids") from None
    spec = PrefillSpec(checkpoint=args.checkpoint, preset=args.preset, num_layers=args.num_layers, dtype=args.dtype,
                       seed=args.seed, pipeline=args.pipeline, ranks=_ranks(args), stage_boundaries=boundaries,
                       mode="scanned" if scan else "layerwise" if layerwise else "whole", **extra)
    return spec, spec.config()


def _need(path: Path, folder: bool, flag: str = "") -> None:
    """`path` exists and is a folder (folder=True) or a regular file; else one line saying which it is not."""
    named, kind = f"{flag} {path}".strip(), "folder" if folder else "file"
    if not path.exists():
        raise UsageError(f"{named}: no such {kind}")
    if not (path.is_dir() if folder else path.is_file()):
        raise UsageError(f"{named}: is not a {'folder' if folder else 'regular file'}")


def _library(call, *args, prefix: str = "", **kwargs):
    """call(...), its plain ValueErrors (a layout, launch options, a file) as one line of bad input; an OptionError
    passes as it is (it names the options)."""
    try:
        return call(*args, **kwargs)
    except ValueError as e:
        if isinstance(e, OptionError):
            raise
        raise UsageError(prefix + str(e)) from None


def _check_options(args) -> list[str] | None:
    """The prefill options that are the command line's own (the spec checks its fields): checked by the launcher of
    a multi-process run before it starts any process, and by every single-process run. Returns the prompts (None:
    token ids or random tokens)."""
    from jax_dwdp.text import read_prompt_file

    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if not args.stall_timeout > 0:
        raise UsageError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    if args.experts is not None and args.dep > 1 and args.experts != "dep":
        raise UsageError(f"--experts {args.experts} is for --dwdp; --dep has one way to move tokens")
    if args.experts is not None and _ranks(args) < 2:
        raise UsageError(f"--experts {args.experts} needs --dwdp N with N >= 2 ranks (it chooses how they get their "
                         "experts)")
    given = [flag for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len)) if value is not None]
    if args.tokens is not None and given:
        raise UsageError(f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} random tokens; with "
                         "--tokens the file gives the shape")
    if args.top_k < 1 or args.generate < 0:
        raise UsageError(f"--top-k must be >= 1 and --generate >= 0, got {args.top_k} and {args.generate}")
    if args.generate and (args.prefill_chunk is not None or args.num_processes > 1):
        raise UsageError("--generate continues one prefill's cache in one process: not with --prefill-chunk or "
                         "--num-processes")
    if not args.prompt and args.prompt_file is None:
        if args.chat:
            raise UsageError("--chat renders --prompt / --prompt-file text: give a prompt")
        return None
    if args.checkpoint is None:
        raise UsageError("--prompt needs --checkpoint DIR with the model's tokenizer.json (a --preset has random "
                         "weights and no tokenizer; give token ids with --tokens FILE.npy)")
    if args.tokens is not None or given:
        raise UsageError("the prompts are the batch: --prompt / --prompt-file do not combine with --tokens, --batch "
                         "or --seq-len")
    if args.num_processes > 1:
        raise UsageError("--prompt runs in one process: not with --num-processes")
    return list(args.prompt or []) + (read_prompt_file(args.prompt_file) if args.prompt_file is not None else [])


def _prefill_inputs(args):
    """The checks every prefill makes before any device work: (spec, cfg, tokens, lengths, prompts, tokenizer)."""
    from jax_dwdp import driver
    from jax_dwdp.outputs import output_file
    from jax_dwdp.text import Tokenizer

    prompts = _check_options(args)
    if args.logits_out is not None:
        args.logits_out = output_file(args.logits_out, "--logits-out")
    spec, cfg = _spec(args, experts=_experts(args), microbatches=args.microbatches, prefill_chunk=args.prefill_chunk,
                      fused_swiglu=args.fused_swiglu, logits="all" if args.logits_out is not None else "last")
    tokenizer = None if prompts is None else Tokenizer.from_checkpoint(args.checkpoint)
    tokens, lengths = (None, None) if prompts is None else tokenizer.batch(prompts, chat=args.chat)
    if args.tokens is not None:
        tokens = _library(driver.read_tokens, args.tokens, prefix="--tokens ")
    shape = {name: value for name, value in (("batch", args.batch), ("seq_len", args.seq_len)) if value is not None}
    try:  # the batch the memory check names is what --batch (or the file) gives
        inputs = _library(driver.prefill_inputs, spec, cfg, tokens, lengths, **shape)
    except UsageError as e:
        raise UsageError(str(e).replace("a batch of ", "--batch ", 1)) from None
    return spec, cfg, *inputs, prompts, tokenizer


def cmd_prefill(args) -> dict:
    from jax_dwdp import driver
    from jax_dwdp.generate import top_k
    from jax_dwdp.native import build_status
    from jax_dwdp.outputs import save_npy_atomically
    from jax_dwdp.parallel.dwdp_ffi import FfiUnavailable
    from jax_dwdp.weights import checksums_checked, precision_notice

    spec, cfg, tokens, lengths, prompts, tokenizer = _prefill_inputs(args)
    notice = precision_notice(args.checkpoint, args.dtype) if args.checkpoint is not None else None
    if notice is not None and not args.process_id:  # once per launch: process 0 says it
        print(f"notice: {notice}", file=sys.stderr)
    try:
        driver.preflight(spec)
    except FfiUnavailable as e:  # no GPU, no driver or no library: one line before any weights are made
        raise UsageError(f"--experts ffi: {e}") from None
    status = (lambda text: None) if args.json or getattr(args, "quiet", False) else \
        (lambda text: print(f"{text} ...", file=sys.stderr, flush=True))  # stderr: stdout keeps the results
    with checksums_checked(not args.no_verify):
        result = driver.run_prefill(spec, cfg, tokens, lengths, iters=args.iters, watchdog=Watchdog(args.stall_timeout),
                                    status=status, generate=args.generate, progress=None if args.json else sys.stderr,
                                    share_gpu=args.share_gpu)
    if result is None:  # one process per device: the last stage's (first) process reports
        return {"reporter": False}
    logits, caches, generated = result.pop("logits"), result.pop("caches"), result.pop("generated", None)
    warning = driver.not_finite(logits, caches)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    if args.logits_out is not None:
        save_npy_atomically(args.logits_out, np.asarray(logits, np.float32), "--logits-out")
    if prompts is not None:
        top = top_k(driver.last_logits(logits, lengths), args.top_k)
        result["text"] = tokenizer.completions(prompts, top, generated)
    elif generated is not None:
        result["generated_ids"] = np.asarray(generated).tolist()
    return {"command": "prefill", **result, "logits_out": str(args.logits_out) if args.logits_out else None,
            "logits_finite": warning is None, "ffi_libraries": build_status()}


def cmd_plan(args) -> dict:
    from jax_dwdp.plan import plan
    from jax_dwdp.planner import prediction_inputs

    spec, cfg = _spec(args)
    options = {"--link": args.link, "--stream": args.stream, "--requests": args.requests,
               "--stream-seed": args.stream_seed, "--bucket": args.bucket, "--dep-exchange": args.dep_exchange}
    given = [flag for flag, value in options.items() if value is not None]
    if args.profile is None and given:  # the performance model's options would do nothing
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the performance model: add "
                         "--profile h200|h100|FILE")
    prediction = None if args.profile is None else prediction_inputs(args.profile, args.link, args.stream,
                                                                     dtype=args.dtype)
    chosen = {name: options[flag] for name, flag in (("requests", "--requests"), ("seed", "--stream-seed"),
                                                     ("bucket", "--bucket"), ("dep_exchange", "--dep-exchange"))
              if options[flag] is not None}
    result = _library(plan, cfg, args.pipeline, spec.ranks, args.dtype, boundaries=spec.stage_boundaries,
                      dep=args.dep > 1, prediction=prediction, **chosen)
    return {"command": "plan", **result, "dwdp": args.dwdp, "dep": args.dep}


def cmd_convert(args) -> dict:
    from jax_dwdp.weights import convert_hf_to_orbax

    dtype = None if args.dtype is None else check_dtype(args.dtype)
    _need(args.hf_dir, True)
    summary = convert_hf_to_orbax(args.hf_dir, args.out_dir, dtype=dtype, overwrite=args.overwrite,
                                  progress=None if args.json else "stderr")
    return {"command": "convert", **summary}


def cmd_verify(args) -> dict:
    from jax_dwdp.weights import verify_checkpoint

    _need(args.directory, True)
    return {"command": "verify", **verify_checkpoint(args.directory)}


COMMANDS = {"prefill": cmd_prefill, "plan": cmd_plan, "convert": cmd_convert, "verify": cmd_verify}


def main(argv: list[str] | None = None) -> int:
    distributed.die_with_parent()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    distributed.quiet_native_logs(args.verbose)
    if args.command == "prefill":
        try:
            _check_processes(args)
            if args.num_processes > 1 and args.process_id is None:  # a launcher checks what every process would,
                _prefill_inputs(args)                                 # before any starts: one line, not one each
        except Exception as e:
            if not _bad_input(e):
                raise
            return _failed(args, e)
        code = distributed.hand_off(argv, num_processes=args.num_processes, coordinator=args.coordinator,
                                    process_id=args.process_id, timeout_s=args.process_timeout, verbose=args.verbose,
                                    share_gpu=args.share_gpu)
        if code is not None:
            return code
    try:
        return _main(args)
    except KeyboardInterrupt:  # what was being written is already removed (e.g. a conversion's partial folder)
        if args.debug:
            raise
        print(f"error: interrupted; {args.command} stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def _check_processes(args) -> None:
    """--num-processes / --coordinator / --process-id: a consistent set, and one device per process."""
    _library(distributed.check_options, args.num_processes, args.coordinator, args.process_id, args.process_timeout)
    if args.num_processes > 1:
        _library(distributed.check_layout, args.num_processes, args.pipeline, _ranks(args), experts=_experts(args),
                 joined=args.coordinator is not None or args.process_id is not None,
                 chunked=args.prefill_chunk is not None, share_gpu=args.share_gpu)
    elif args.share_gpu:
        raise UsageError("--share-gpu shares one GPU between the processes of a launch: give --num-processes N")


def _main(args) -> int:
    if getattr(args, "process_id", None) is not None:  # (the process options were checked by main)
        distributed.join_launch(args.coordinator, args.num_processes, args.process_id, timeout_s=args.process_timeout)
        args.quiet = args.process_id != 0  # process 0 reports progress
    else:
        distributed.ensure_host_devices(getattr(args, "pipeline", 1) * max(getattr(args, "dwdp", 1),
                                                                           getattr(args, "dep", 1)))
    try:
        result = COMMANDS[args.command](args)
    except Exception as e:
        return _failed(args, e)
    if result.pop("reporter", True):  # (else another process of the launch reports)
        from jax_dwdp import report

        report.print_result(result, as_json=args.json)
    return 0


def _failed(args, e: Exception) -> int:
    """One line on stderr for a command that failed (--debug: the traceback instead) and its exit status: 2 for
    bad input, 1 for anything else (a device or XLA failure)."""
    if args.debug:
        raise e
    if _bad_input(e):
        print(f"error: {e.named(_flag(args)) if isinstance(e, OptionError) else e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"error: {type(e).__name__}: {first} (run with --debug for the traceback)", file=sys.stderr)
    return EXIT_RUNTIME


def _bad_input(e: Exception) -> bool:
    return isinstance(e, OptionError) or type(e).__name__ in BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
