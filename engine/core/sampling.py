"""Turning logits into tokens: temperature / top-k / top-p warping and per-row seeded sampling.

The same `warp` is applied to the target's and the draft's logits, so speculative rejection sampling
compares the two distributions the user asked for. Each row owns a `torch.Generator` seeded from the
recipe seed and the row's id, so a row's samples do not depend on which slot or batch it ran in.
This module does not decide acceptance (see `verification`).
"""

from __future__ import annotations

import hashlib

import torch

from engine.config.schema import SamplingConfig


def row_generator(seed: int, row_id: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on (recipe seed, row id): reproducible run to run."""
    digest = hashlib.sha256(f"{seed}\x00{row_id!r}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def warp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (transformers' order).

    logits: [..., vocab] -> probs: [..., vocab] (float32). Requires temperature > 0.
    """
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - sampling.top_p)  # the low tail whose mass is <= 1 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row drawing from its own generator. probs: [B, vocab] -> [B]."""
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def uniform_rows(count: int, generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """`count` uniforms in [0, 1) per row from each row's generator: [B, count]."""
    return torch.stack([torch.rand(count, generator=g, device=device) for g in generators])
