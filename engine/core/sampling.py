"""Turning logits into tokens: temperature / top-k / top-p warping, per-row seeded sampling, and the
per-row sampling of a batch whose rows each have their own parameters.

The same `warp` is applied to the target's and the draft's logits, so speculative rejection sampling
compares the two distributions the user asked for. Each row owns a `torch.Generator` seeded from its
seed and its id (or its own seed alone, when the row set one), so a row's samples do not depend on
which slot or batch it ran in. `BatchSampling` groups a batch's rows by their warping (greedy rows
take the argmax) so that a batch of identical rows, the common case, costs one vectorised call.
This module does not decide acceptance (see `engine.spec.verification`).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from engine.config.schema import SamplingConfig

ROW_SEED_ONLY = object()  # row_generator(seed, ROW_SEED_ONLY): the stream depends on the seed alone


def row_generator(seed: int, row_id: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on (seed, row id), or on the seed alone for
    `ROW_SEED_ONLY`: reproducible run to run."""
    text = f"{seed}" if row_id is ROW_SEED_ONLY else f"{seed}\x00{row_id!r}"
    digest = hashlib.sha256(text.encode()).digest()
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


class SampledGroup:
    """Rows of a batch that share one warping: their row indices ([R], None = every row of the
    batch), that warping's parameters, and each row's generator."""

    def __init__(self, rows: torch.Tensor | None, params: SamplingConfig, generators: list[torch.Generator]):
        self.rows = rows
        self.params = params
        self.generators = generators


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, the first index among equal maxima, as `argmax` gives it:
    `max(...).indices` takes ~3x less time than `argmax` on CPU over a decode step's [16, 49152]
    float32 logits (BENCHMARKS.md section 29a)."""
    return logits.max(dim=-1).indices


class BatchSampling:
    """How each row of one batch turns logits into tokens, every row under its own parameters.

    `greedy_rows` ([G] indices, None = none) take the argmax; `groups` are the sampled rows, one
    `SampledGroup` per distinct warping (temperature, top_p, top_k). When every row has the same
    parameters (all greedy, or one group with rows None) nothing is indexed: one call, as for a
    single recipe-wide setting.
    """

    def __init__(self, params: Sequence[SamplingConfig], generators: Sequence[torch.Generator | None],
                 device: torch.device):
        self.size = len(params)
        self.greedy_rows: torch.Tensor | None = None
        self.groups: list[SampledGroup] = []
        first = params[0]
        # Rows without values of their own share the recipe's object: the common case, checked cheaply.
        warpings = None if all(p is first for p in params) else [p.warping for p in params]
        if warpings is None or all(w == warpings[0] for w in warpings):
            if not first.greedy:
                self.groups.append(SampledGroup(None, first, list(generators)))
            return
        by_warping: dict[tuple, list[int]] = {}
        greedy = []
        for b, w in enumerate(warpings):
            (greedy if w is None else by_warping.setdefault(w, [])).append(b)
        if greedy:
            self.greedy_rows = torch.tensor(greedy, dtype=torch.long, device=device)
        for rows in by_warping.values():
            self.groups.append(SampledGroup(torch.tensor(rows, dtype=torch.long, device=device),
                                            params[rows[0]], [generators[b] for b in rows]))

    @classmethod
    def of(cls, seqs, device: torch.device) -> "BatchSampling":
        """For engine sequences (anything with `.sampling` and `.generator`)."""
        return cls([s.sampling for s in seqs], [s.generator for s in seqs], device)

    @property
    def all_greedy(self) -> bool:
        return not self.groups

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next tokens [B] from logits [B, vocab], and the distributions the sampled rows drew from
        ([B, vocab], float32; greedy rows' rows are zeros), or None when every row is greedy."""
        if self.all_greedy:
            return greedy_tokens(logits), None
        if self.groups[0].rows is None:  # one warping for the whole batch
            group = self.groups[0]
            probs = warp(logits, group.params)
            return sample_rows(probs, group.generators), probs
        tokens = greedy_tokens(logits)  # [B]; the greedy rows keep theirs
        probs = logits.new_zeros(logits.shape, dtype=torch.float32)  # [B, vocab]
        for group in self.groups:
            group_probs = warp(logits[group.rows], group.params)  # [R, vocab]
            probs[group.rows] = group_probs
            tokens[group.rows] = sample_rows(group_probs, group.generators)
        return tokens, probs
