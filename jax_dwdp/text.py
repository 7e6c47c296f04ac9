"""Text in, text out: prompts through a checkpoint's own tokenizer, the next tokens decoded.

- `Tokenizer.from_checkpoint(folder)`: the folder's `tokenizer.json` (Hugging Face `tokenizers`) and, when present,
  `tokenizer_config.json` (its chat template and special tokens). `batch(prompts, chat=)` gives the int32
  [B, T] tokens (right-padded) and the lengths a prefill takes; `chat=True` first renders each prompt as one user
  turn through the checkpoint's chat template (Jinja, sandboxed, as transformers renders it).
  `completions(prompts, top, generated)`: the next tokens and the continuation of each prompt as text.
- `read_prompt_file(path)`: one prompt per line, or a JSON list of strings.
Ids to text and back only: the next tokens themselves come from jax_dwdp.generate (top_k, greedy), which needs
neither `tokenizers` nor Jinja (a prefill from token ids never imports this module).

Bad input (no tokenizer, an unreadable file, an empty prompt) raises `TextError` naming the file or prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = ["TextError", "Tokenizer", "read_prompt_file", "write_small_tokenizer"]

# A ChatML template (the form Qwen's checkpoints use), for the small tokenizer below.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ("The quick brown fox jumps over the lazy dog. A prefill reads the whole prompt at once; the decode step "
          "then writes one token at a time. Each GPU keeps part of every layer's experts and copies the rest from "
          "its peers while the layer before computes. Hello world, how are you today?").split(". ")


class TextError(ValueError):
    """A prompt, prompt file or tokenizer that cannot be used; the message names it."""


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A checkpoint's tokenizer (see the module doc)."""

    def __init__(self, tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, source: str = "tokenizer"):
        self.tokenizer, self.chat_template, self.source = tokenizer, chat_template, source
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TextError(f"{folder} has no tokenizer.json: prompts as text need the checkpoint's tokenizer "
                            "(give token ids with --tokens FILE.npy instead)")
        try:
            tokenizer = HfTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TextError(f"{path} is not a tokenizer the `tokenizers` library can read: {e}") from None
        config = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TextError(f"{config_path} cannot be read as JSON: {e}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(tokenizer, chat_template=template if isinstance(template, str) else None,
                   bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token")),
                   source=str(folder))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(self, prompt: str) -> str:
        """The prompt as one user turn of the checkpoint's chat template, ending where the assistant answers."""
        if self.chat_template is None:
            raise TextError(f"{self.source}: tokenizer_config.json has no chat_template (drop --chat)")
        def raise_exception(message):
            raise TextError(f"{self.source}: the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TextError(f"{self.source}: the chat template cannot be rendered: {e}") from None

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of one prompt: as transformers' tokenizer(prompt) gives them, or its apply_chat_template."""
        if not prompt:
            raise TextError("an empty prompt: every prompt needs at least one character")
        if chat:  # the template writes the special tokens itself
            return self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=False).ids
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def batch(self, prompts: Sequence[str], *, chat: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [B, T] right-padded with 0, lengths int32 [B]) of the prompts, T the longest."""
        if not prompts:
            raise TextError("no prompt given")
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.encode(prompt, chat=chat))
            except TextError as e:
                raise TextError(f"prompt {i + 1}: {e}") from None
            if not ids[-1]:
                raise TextError(f"prompt {i + 1} ({prompt[:40]!r}) gives no tokens")
        lengths = np.array([len(x) for x in ids], np.int32)
        tokens = np.zeros((len(ids), int(lengths.max())), np.int32)
        for row, x in enumerate(ids):
            tokens[row, :len(x)] = x
        return tokens, lengths

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def completions(self, prompts: Sequence[str], top, generated=None) -> list[dict]:
        """Per prompt, what `jax-dwdp prefill` reports of it: its most likely next tokens with their text (`top`: per
        prompt [(id, probability)], as generate.top_k gives them) and, with `generated` [B, N] ids, the continuation
        as ids and text."""
        out = []
        for row, (prompt, best) in enumerate(zip(prompts, top)):
            item = {"prompt": prompt, "next_tokens": [{"id": i, "text": self.decode([i]), "p": round(p, 6)}
                                                      for i, p in best]}
            if generated is not None:
                ids = [int(i) for i in np.asarray(generated)[row]]
                item.update(generated_ids=ids, generated_text=self.decode(ids))
            out.append(item)
        return out


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, or else one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise TextError(f"{path}: no such file" if not path.exists() else f"{path} is not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise TextError(f"{path} cannot be read: {e.strerror or e}") from None
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise TextError(f"{path} starts like a JSON list but is not JSON: {e.msg} at line {e.lineno}") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise TextError(f"{path}: a JSON prompt file must be a list of strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise TextError(f"{path} holds no prompt")
    return prompts


def write_small_tokenizer(folder: str | Path, vocab_size: int, corpus: Sequence[str] = CORPUS) -> Path:
    """Writes a byte-level BPE tokenizer (the 256 bytes, <|im_start|> / <|im_end|> / <unk>, and merges learnt from
    `corpus` up to `vocab_size` ids) as `tokenizer.json` and a ChatML `tokenizer_config.json` into `folder`: text in
    and out for a small random checkpoint (weights/hf_export.py), not a real model's vocabulary."""
    if vocab_size < 259:
        raise ValueError(f"a byte-level tokenizer needs at least 259 ids (256 bytes, 3 special), got {vocab_size}")
    folder = Path(folder)
    tok = HfTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    return folder
