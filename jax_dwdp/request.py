"""A whole prefill request: what `jax-dwdp prefill` runs, as one object a notebook or a script runs alike.

    request = PrefillRequest(PrefillSpec(preset="tiny", pipeline=2), batch=2, seq_len=128, iters=3)
    result = request.run()          # the dict `jax-dwdp prefill --json` prints (without its "command")

A request holds the spec (driver.PrefillSpec: the model, its layout and execution mode), where the tokens come from
(random `batch` x `seq_len` ids, a `tokens` .npy file or array, or `prompts` / a `prompt_file` of text, optionally
as `chat` turns), and what to do with the result (`iters` timed runs, `generate` greedy tokens, the `top_k` next
tokens of each prompt, `logits_out` to a file). It checks how its fields combine when it is made (RequestError,
naming the fields as options.OptionError does, so that the CLI names its flags); `prepare()` reads and checks the
inputs before any device work (what a launcher checks before it starts processes); `run()` prepares, builds,
measures and reports.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jax_dwdp.driver import PrefillSpec, last_logits, not_finite, preflight, prefill_inputs, read_tokens, run_prefill
from jax_dwdp.families import FamilyConfig
from jax_dwdp.generate import top_k
from jax_dwdp.native import build_status
from jax_dwdp.options import OptionError, literal
from jax_dwdp.outputs import output_file, save_npy_atomically
from jax_dwdp.prefill import InputError
from jax_dwdp.text import Tokenizer, read_prompt_file
from jax_dwdp.watchdog import DEFAULT_STALL_S, Watchdog
from jax_dwdp.weights import checksums_checked, precision_notice


# Why --share-gpu runs one microbatch of a batch the ranks divide: the output rows of a split batch live in several
# processes, so padding dropped or microbatches joined on the devices is a collective, and NCCL refuses two ranks
# on one GPU (benchmarks/RESULTS.md). The logits themselves are gathered through the host (distributed.host_gather).
SHARED_GPU_COLLECTIVE = "outputs across processes is a device collective, which NCCL refuses on one GPU"


class RequestError(OptionError):
    """A request whose fields do not combine or are out of range; the message names the fields as $name
    (options.OptionError)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class Inputs(NamedTuple):
    """A request's inputs, read and checked (`PrefillRequest.prepare`)."""

    cfg: FamilyConfig
    tokens: np.ndarray  # int32 [B, T]
    lengths: np.ndarray  # int32 [B]
    prompts: list[str] | None  # the text of each row (None: token ids or random tokens)
    tokenizer: Tokenizer | None
    logits_out: Path | None  # the checked regular file the logits go to


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillRequest:
    """One prefill to run and report: the `spec` and the token source (one of: random `batch` x `seq_len` ids of
    the spec's seed, the default 1 x 128; `tokens`, a .npy file or an int32 [B, T] array; `prompts` and / or a
    `prompt_file`, text the checkpoint's tokenizer turns into the batch, each a user turn of its chat template with
    `chat`), `iters` timed runs after the warm-up, `generate` N greedy tokens per sequence, the `top_k` likeliest
    next tokens of each prompt, `logits_out` (a file for every position's float32 logits: the spec then returns
    them all), `share_gpu` (the `num_processes` of this launch share one GPU), `stall_timeout` (seconds one step may
    go without finishing; None: no bound) and `verify` (an Orbax checkpoint's checksums). Fields that do not combine
    raise RequestError when the request is made."""

    spec: PrefillSpec
    tokens: str | Path | np.ndarray | None = None
    batch: int | None = None
    seq_len: int | None = None
    prompts: Sequence[str] = ()
    prompt_file: str | Path | None = None
    chat: bool = False
    iters: int = 3
    generate: int = 0
    top_k: int = 5
    logits_out: str | Path | None = None
    share_gpu: bool = False
    num_processes: int = 1  # the processes of the launch that runs this request, each the same request
    stall_timeout: float | None = DEFAULT_STALL_S
    verify: bool = True

    def __post_init__(self):
        # (object.__setattr__: the dataclass is frozen) a lone string is one prompt, not one per character
        object.__setattr__(self, "prompts", (self.prompts,) if isinstance(self.prompts, str) else tuple(self.prompts))
        if self.logits_out is not None and self.spec.logits != "all":  # the file holds every position's logits
            object.__setattr__(self, "spec", dataclasses.replace(self.spec, logits="all"))
        if self.iters < 1:
            raise RequestError(f"$iters must be >= 1, got {self.iters}")
        if self.stall_timeout is not None and not self.stall_timeout > 0:
            raise RequestError(f"$stall_timeout must be > 0 seconds, got {self.stall_timeout:g}")
        if self.num_processes < 1:
            raise RequestError(f"$num_processes must be >= 1, got {self.num_processes}")
        shaped = [name for name in ("batch", "seq_len") if getattr(self, name) is not None]
        if self.tokens is not None and shaped:
            raise RequestError(f"{' and '.join('$' + n for n in shaped)} {'shape' if len(shaped) > 1 else 'shapes'} "
                               "random tokens; with $tokens the file gives the shape")
        if self.top_k < 1 or self.generate < 0:
            raise RequestError(f"$top_k must be >= 1 and $generate >= 0, got {self.top_k} and {self.generate}")
        if self.generate and (self.spec.prefill_chunk is not None or self.num_processes > 1):
            raise RequestError("$generate continues one prefill's cache in one process: not with $prefill_chunk or "
                               "$num_processes")
        if self.share_gpu and self.num_processes < 2:
            raise RequestError("$share_gpu shares one GPU between the processes of a launch: give $num_processes N")
        if self.share_gpu and self.spec.microbatches > 1:
            raise RequestError(f"$share_gpu runs one microbatch, not {self.spec.microbatches}: joining microbatches' "
                               f"{SHARED_GPU_COLLECTIVE}")
        if not self.text:
            if self.chat:
                raise RequestError("$chat renders $prompts / $prompt_file text: give a prompt")
            return
        if self.spec.checkpoint is None:
            raise RequestError("$prompts needs $checkpoint DIR with the model's tokenizer.json (a $preset has random "
                               "weights and no tokenizer; give token ids with $tokens FILE.npy)")
        if self.tokens is not None or shaped:
            raise RequestError("the prompts are the batch: $prompts / $prompt_file do not combine with $tokens, $batch "
                               "or $seq_len")
        if self.num_processes > 1:
            raise RequestError("$prompts runs in one process: not with $num_processes")

    @property
    def text(self) -> bool:
        """Whether the batch is text (prompts or a prompt file)."""
        return bool(self.prompts) or self.prompt_file is not None

    def prepare(self) -> Inputs:
        """The inputs, read and checked before any device work: the prompts (read, tokenized), the token ids (read,
        drawn) against the model's vocabulary, the host's memory and the layout (driver.prefill_inputs), the logits
        file (writable, outputs.output_file). Refused with the library's errors, a file naming its field."""
        prompts = None
        if self.text:
            prompts = list(self.prompts) + (read_prompt_file(self.prompt_file) if self.prompt_file is not None else [])
        logits_out = None if self.logits_out is None else output_file(str(self.logits_out), "$logits_out")
        cfg = self.spec.config()
        tokenizer = None if prompts is None else Tokenizer.from_checkpoint(self.spec.checkpoint)
        tokens, lengths = (None, None) if prompts is None else tokenizer.batch(prompts, chat=self.chat)
        if isinstance(self.tokens, (str, Path)):
            try:
                tokens = read_tokens(self.tokens)
            except InputError as e:
                raise RequestError(f"$tokens {literal(e)}") from None
        elif self.tokens is not None:
            tokens = self.tokens
        shape = {name: getattr(self, name) for name in ("batch", "seq_len") if getattr(self, name) is not None}
        try:
            tokens, lengths = prefill_inputs(self.spec, cfg, tokens, lengths, **shape)
        except InputError as e:
            if tokens is not None:
                raise
            raise RequestError(f"{literal(e)}; lower $batch or $seq_len") from None  # random tokens the host cannot hold
        except OptionError:
            raise
        except ValueError as e:  # a layout that cannot take the batch (the library's plain ValueError)
            raise RequestError(str(e)) from None
        if self.share_gpu and tokens.shape[0] % self.spec.ranks:
            raise RequestError(f"$share_gpu needs a batch that the {self.spec.ranks} ranks divide, got "
                               f"{tokens.shape[0]} sequences: dropping the padding rows' {SHARED_GPU_COLLECTIVE}")
        return Inputs(cfg, tokens, lengths, prompts, tokenizer, logits_out)

    def run(self, *, status: Callable[[str], None] | None = None, progress=None,
            notes: Callable[[str], None] = _stderr) -> dict | None:
        """Prepares, builds, measures and reports, as `jax-dwdp prefill` does: the numbers of driver.measure, the
        logits written to `logits_out`, each prompt's `top_k` next tokens and continuation ("text") or the
        generated ids ("generated_ids"), whether the logits are finite, the FFI libraries. None in a process of a
        launch that does not report (driver.Driver.reports). `status(text)` is told each phase, `progress` (a
        stream) gets the loading and building progress lines, `notes(line)` a "notice: ..." (weights stored
        narrower than the spec's dtype; once per launch) and a "warning: ..." (logits not finite)."""
        from jax_dwdp.parallel.cuda_vmm import FfiUnavailable  # CUDA-only module (imported without CUDA, though)

        inputs = self.prepare()
        notice = precision_notice(self.spec.checkpoint, self.spec.dtype) if self.spec.checkpoint is not None else None
        if notice is not None and jax.process_index() == 0:  # once per launch
            notes(f"notice: {notice}")
        try:
            preflight(self.spec)
        except FfiUnavailable as e:  # no GPU, no driver or no library: one line before any weights are made
            raise RequestError(f"$experts {self.spec.experts_word}: {e}") from None
        watchdog = None if self.stall_timeout is None else Watchdog(self.stall_timeout)
        with checksums_checked(self.verify):
            result = run_prefill(self.spec, inputs.cfg, inputs.tokens, inputs.lengths, iters=self.iters,
                                 watchdog=watchdog, status=status, generate=self.generate, progress=progress,
                                 share_gpu=self.share_gpu)
        if result is None:
            return None
        logits, caches, generated = result.pop("logits"), result.pop("caches"), result.pop("generated", None)
        warning = not_finite(logits, caches)
        if warning is not None:
            notes(f"warning: {warning}")
        if inputs.logits_out is not None:
            save_npy_atomically(inputs.logits_out, np.asarray(logits, np.float32), "$logits_out")
        if inputs.prompts is not None:
            top = top_k(last_logits(logits, inputs.lengths), self.top_k)
            result["text"] = inputs.tokenizer.completions(inputs.prompts, top, generated)
        elif generated is not None:
            result["generated_ids"] = np.asarray(generated).tolist()
        return {**result, "logits_out": None if inputs.logits_out is None else str(inputs.logits_out),
                "logits_finite": warning is None, "ffi_libraries": build_status()}
