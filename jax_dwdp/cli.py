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

from jax_dwdp import distributed
from jax_dwdp.options import MAX_SEED, OptionError, check_dtype
from jax_dwdp.watchdog import DEFAULT_STALL_S

EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
# Bad input besides OptionError (the spec's, the request's, the planner's, an output file's), by name: the library's
# modules load late.
BAD_INPUT = ("UsageError", "ConfigError", "InputError", "CheckpointError", "TextError")


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
    --dwdp / --dep given; a request's prompts: --prompt, repeated)."""
    own = {"ranks": "--dep" if args.dep > 1 else "--dwdp", "prompts": "--prompt"}
    return lambda name: own.get(name) or "--" + name.replace("_", "-")


def _spec(args, **extra):
    """The library's PrefillSpec of a prefill (or plan) command line; the spec checks its own fields
    (driver.SpecError)."""
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
    return PrefillSpec(checkpoint=args.checkpoint, preset=args.preset, num_layers=args.num_layers, dtype=args.dtype,
                       seed=args.seed, pipeline=args.pipeline, ranks=_ranks(args), stage_boundaries=boundaries,
                       mode="scanned" if scan else "layerwise" if layerwise else "whole", **extra)


def _need(path: Path, folder: bool, flag: str = "") -> None:
    """`path` exists and is a folder (folder=True) or a regular file; else one line saying which it is not."""
    named, kind = f"{flag} {path}".strip(), "folder" if folder else "file"
    if not path.exists():
        raise UsageError(f"{named}: no such {kind}")
    if not (path.is_dir() if folder else path.is_file()):
        raise UsageError(f"{named}: is not a {'folder' if folder else 'regular file'}")


def _library(call, *args, **kwargs):
    """call(...), its plain ValueErrors (a layout, launch options) as one line of bad input; an OptionError passes
    as it is (it names the options)."""
    try:
        return call(*args, **kwargs)
    except OptionError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def _request(args):
    """The library's PrefillRequest of a prefill command line: its spec and its own fields, each checking how its
    fields combine (driver.SpecError, request.RequestError); here only what two flags for one field get wrong."""
    from jax_dwdp.request import PrefillRequest

    if args.experts is not None and args.dep > 1 and args.experts != "dep":
        raise UsageError(f"--experts {args.experts} is for --dwdp; --dep has one way to move tokens")
    if args.experts is not None and _ranks(args) < 2:
        raise UsageError(f"--experts {args.experts} needs --dwdp N with N >= 2 ranks (it chooses how they get their "
                         "experts)")
    spec = _spec(args, experts=_experts(args), microbatches=args.microbatches, prefill_chunk=args.prefill_chunk,
                 fused_swiglu=args.fused_swiglu)
    return PrefillRequest(spec, tokens=args.tokens, batch=args.batch, seq_len=args.seq_len, prompts=args.prompt or (),
                          prompt_file=args.prompt_file, chat=args.chat, iters=args.iters, generate=args.generate,
                          top_k=args.top_k, logits_out=args.logits_out, share_gpu=args.share_gpu,
                          num_processes=args.num_processes, stall_timeout=args.stall_timeout,
                          verify=not args.no_verify)


def cmd_prefill(args) -> dict | None:
    status = None if args.json or args.process_id else \
        (lambda text: print(f"{text} ...", file=sys.stderr, flush=True))  # process 0's, on stderr (stdout: results)
    result = _request(args).run(status=status, progress=None if args.json else sys.stderr)
    return None if result is None else {"command": "prefill", **result}  # (None: another process reports)


def cmd_plan(args) -> dict:
    from jax_dwdp.plan import plan

    spec = _spec(args)
    model = {name: getattr(args, name) for name in ("profile", "link", "stream", "requests", "bucket", "dep_exchange")}
    result = _library(plan, spec.config(), args.pipeline, spec.ranks, args.dtype, boundaries=spec.stage_boundaries,
                      dep=args.dep > 1, seed=args.stream_seed, **model)
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
        try:  # the launch's options, one device per process
            _library(distributed.check_options, args.num_processes, args.coordinator, args.process_id,
                     args.process_timeout)
            if args.num_processes > 1:
                _library(distributed.check_layout, args.num_processes, args.pipeline, _ranks(args),
                         experts=_experts(args), joined=args.coordinator is not None or args.process_id is not None,
                         chunked=args.prefill_chunk is not None, share_gpu=args.share_gpu)
            if args.num_processes > 1 and args.process_id is None:  # a launcher checks what every process would,
                _request(args).prepare()                              # before any starts: one line, not one each
        except Exception as e:
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


def _main(args) -> int:
    if getattr(args, "process_id", None) is not None:  # (the process options were checked by main)
        distributed.join_launch(args.coordinator, args.num_processes, args.process_id, timeout_s=args.process_timeout)
    else:
        distributed.ensure_host_devices(getattr(args, "pipeline", 1) * max(getattr(args, "dwdp", 1),
                                                                           getattr(args, "dep", 1)))
    try:
        result = COMMANDS[args.command](args)
    except Exception as e:
        return _failed(args, e)
    if result is not None:  # (else another process of the launch reports)
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
