"""Calibration and evaluation text for quantization: the Lee news corpus, split once.

The corpus (`minillm.data.lee_corpus`, 300 articles, about 75K SmolLM2 tokens) is split by
article, so calibration and evaluation never share a sentence:

- the first 240 articles calibrate: `calibration_windows` draws windows of `seqlen` tokens
  at seeded random offsets from their token stream (as GPTQ draws from C4);
- the last 60 evaluate: `evaluation_text` (about 15K tokens).

Both are fixed: the same calls give the same tokens on every machine.
"""
from __future__ import annotations

import torch

from ..data import lee_corpus

NUM_CALIBRATION_ARTICLES = 240
SEPARATOR = "\n\n"


def calibration_text() -> str:
    return SEPARATOR.join(lee_corpus()[:NUM_CALIBRATION_ARTICLES])


def evaluation_text() -> str:
    """The held-out articles, joined by blank lines."""
    return SEPARATOR.join(lee_corpus()[NUM_CALIBRATION_ARTICLES:])


def calibration_windows(tokenizer, n: int = 128, seqlen: int = 512, seed: int = 0) -> torch.Tensor:
    """[n, seqlen] token ids: windows at random offsets (seeded) into the calibration text."""
    for name, v in (("n", n), ("seqlen", seqlen)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    ids = torch.tensor(tokenizer.encode(calibration_text()), dtype=torch.long)
    if len(ids) <= seqlen:
        raise ValueError(f"seqlen {seqlen} exceeds the calibration text ({len(ids)} tokens)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (n,), generator=g)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])
