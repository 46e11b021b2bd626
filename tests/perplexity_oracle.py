"""Perplexity computed in the tests themselves, as the yardstick for quantization methods: the
model's float32 logits, a log-softmax in numpy float64, exp(mean next-token NLL) over windows."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def perplexity(model, ids: list[int], window: int = 512) -> float:
    nll = 0.0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        logits = np.array(model(mx.array([chunk[:-1]]))[0].astype(mx.float32), dtype=np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        nll -= logp[np.arange(len(chunk) - 1), chunk[1:]].sum()
    return math.exp(nll / (len(ids) - 1))
