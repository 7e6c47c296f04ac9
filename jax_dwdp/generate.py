"""The next tokens of a prefill: the most likely ones with their probabilities, and greedy continuation.

- `top_k(last_logits, k)`: each sequence's k most likely next tokens with their probabilities (float64 softmax).
- `greedy(decode, last_logits, cache, n)`: n greedy tokens continuing from a prefill's caches with the model's
  decode step (the reference step, prefill.jit_decode_step: correctness, not speed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["top_k", "greedy"]


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
