"""Text in, text out: prompts through a checkpoint's own tokenizer, the next tokens decoded.

- `Tokenizer.from_checkpoint(folder)`: the folder's `tokenizer.json` (Hugging Face `tokenizers`) and, when present,
  `tokenizer_config.json` (its chat template and special tokens). `batch(prompts, chat=)` gives the int32
  [B, T] tokens (right-padded) and the lengths a prefill takes; `chat=True` first renders each prompt as one user
  turn through the checkpoint's chat template (Jinja, sandboxed, as transformers renders it).
- `read_prompt_file(path)`: one prompt per line, or a JSON list of strings.
- `top_k(last_logits, k)`: each sequence's k most likely next tokens with their probabilities.
- `greedy(decode, last_logits, cache, n)`: n greedy tokens continuing from a prefill's caches with the model's
  decode step (the reference step: correctness, not speed).

Bad input (no tokenizer, an unreadable file, an empty prompt) raises `TextError` naming the file or prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

__all__ = ["TextError", "Tokenizer", "read_prompt_file", "top_k", "greedy"]


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


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def top_k(last_logits, k: int) -> list[list[tuple[int, float]]]:
    """Per sequence, the k most likely next tokens (id, probability), most likely first; last_logits [B, V]."""
    logits = np.asarray(last_logits, np.float32)
    if logits.ndim != 2:
        raise ValueError(f"top_k: logits of shape {logits.shape}, expected [B, V]")
    k = max(1, min(k, logits.shape[1]))
    probs = _softmax(logits)
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return [[(int(i), float(probs[b, i])) for i in order[b]] for b in range(logits.shape[0])]


def greedy(decode: Callable, last_logits, cache, n: int) -> np.ndarray:
    """n greedy tokens per sequence [B, n]: the argmax of the prefill's last logits, then each decode step's
    (`decode(tokens [B], cache) -> (logits [B, V], cache)`, e.g. prefill.jit_decode_step(model)). The cache must have
    room for n - 1 more positions past every sequence's length."""
    if n < 1:
        return np.zeros((np.asarray(last_logits).shape[0], 0), np.int32)
    out = [np.argmax(np.asarray(last_logits, np.float32), axis=-1).astype(np.int32)]
    for _ in range(n - 1):
        logits, cache = decode(out[-1], cache)
        out.append(np.argmax(np.asarray(logits, np.float32), axis=-1).astype(np.int32))
    return np.stack(out, axis=1)
