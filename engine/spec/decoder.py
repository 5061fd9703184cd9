"""MagicDec's decoder: the rows after prefill advance by speculative rounds whose gamma the policy picks.

`SpeculativeDecoder` is the `engine.core.scheduler.Decoder` of every job: it owns the draft (the
target's weights reading a compressed view of the target cache, or a separate model with its own
cache), the compressor choosing that view, the draft step (`engine.spec.draft`), the rounds
(`engine.spec.rounds`) and the gamma policy (`engine.spec.gamma`); `draft.method: none` is the same
decoder with gamma fixed at 0 (plain decoding through the same rounds). `build_engine` puts it and
the target's runner inside a `Scheduler`: the one decode loop that `magicdec run` and `magicdec
bench` both drive. Not here: files, prompts, reports (`engine.job`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.config.schema import Recipe, round_scratch, slot_capacity
from engine.core.prefix_store import PrefixStore
from engine.core.runner import ModelRunner
from engine.core.sampling import BatchSampling
from engine.core.scheduler import PrefillTarget, RoundRecord, Scheduler
from engine.core.sequence import Sequence
from engine.core.stats import EngineStats
from engine.errors import JobError
from engine.models.loading import LoadedModel
from engine.spec.compressors.base import Compressor
from engine.spec.compressors.registry import COMPRESSORS
from engine.spec.draft.forward import LeanDraft, ModuleDraft, draft_forward_for
from engine.spec.gamma import GammaPolicy
from engine.spec.rounds import RoundRunner


class SpeculativeDecoder:
    def __init__(self, recipe: Recipe, target: ModelRunner, draft: ModelRunner | None, stats: EngineStats,
                 *, sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 agree: Callable[[int], int] | None = None,
                 stores: tuple[PrefixStore | None, PrefixStore | None] = (None, None)):
        """draft: None for plain decoding, `target` for self-speculation, else a separate model's runner.
        sync: makes every tensor-parallel rank use rank 0's token tensors; agree: the same for a
        Python int (the gamma each round, which rank 0 picks from its own timings). stores: the
        prefix K/V stores of the target's cache and of a separate draft's."""
        self.target, self.draft, self.stats = target, draft, stats
        method = recipe.draft.method
        self.compressor: Compressor | None = None
        self.draft_forward: LeanDraft | ModuleDraft | None = None  # the draft step (its GEMM dtype, its path)
        if draft is not None:
            self.compressor = COMPRESSORS[method](recipe.draft, draft.cache, draft.heads)
            self.draft_forward = draft_forward_for(recipe.draft.linear_dtype, draft, self.compressor,
                                                   extra=round_scratch(recipe), self_speculation=draft is target)
        self.rounds = RoundRunner(target, draft, self.compressor, stats, sync, self.draft_forward)
        self.policy = GammaPolicy(recipe.spec.gamma, recipe.spec.gamma_max, recipe.spec.replan_every,
                                  speculative=draft is not None)
        self.agree = agree or (lambda value: value)
        self.separate_draft = draft is not None and draft is not target
        # A self-speculating guided draft's view comes from the target's full-cache forwards.
        self.refreshes_view = draft is target and self.compressor is not None and self.compressor.wants_mass
        # Every admitted prompt goes into the target's cache (the compressor watches it when the draft
        # reads the target's cache) and into a separate draft's own cache (which it watches then).
        self.prefill_targets = [PrefillTarget(target, self.compressor if draft is target else None, stores[0])]
        if self.separate_draft:
            self.prefill_targets.append(PrefillTarget(draft, self.compressor, stores[1]))

    def start(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        if self.compressor is not None:
            self.stats.select_s += self.compressor.timer.take()
        first, _ = self.rounds.choose(logits, BatchSampling.of(seqs, logits.device))
        for seq, token in zip(seqs, first.tolist()):
            seq.extend([token])
            if self.separate_draft:  # see RoundRunner: a separate draft recomputes its newest position
                self.draft.cache.set_length(seq.slot, seq.prompt_len - 1)

    def step(self, seqs: list[Sequence]) -> RoundRecord:
        gamma = self.agree(self.policy.next_gamma())
        # A guided view read by a probe (or the first round back to speculation) is chosen in the plain
        # round before it, not rounds before; every rank takes rank 0's answer, as for gamma.
        refresh = False
        if not gamma and self.refreshes_view:
            refresh = bool(self.agree(int(self.policy.speculates_after_plain_round())))
        before = self.stats.decode_tokens
        t0 = time.perf_counter()
        draft_s, verify_s, select_s, accepted = self.rounds.run(seqs, gamma, refresh_view=refresh)
        seconds = time.perf_counter() - t0
        self.stats.decode_s += seconds
        # A selection after verification (the guided view) is a per-round cost, like verification's;
        # a plain round's is the next round's preparation, not part of T_T.
        self.policy.observe(gamma=gamma, rows=len(seqs), draft_s=draft_s,
                            verify_s=verify_s + (select_s if gamma else 0.0), accepted=accepted)
        return RoundRecord(rows=len(seqs), gamma=gamma, seconds=seconds, draft_s=draft_s, verify_s=verify_s,
                           emitted=self.stats.decode_tokens - before, select_s=select_s)

    def release(self, slot: int) -> None:
        if self.separate_draft:
            self.draft.cache.clear(slot)
        if self.compressor is not None:
            self.compressor.release(slot)

    @property
    def cache_bytes(self) -> int:
        """What the decoder holds beyond the target's cache: a separate draft's cache, a compact store."""
        total = self.draft.cache.nbytes if self.separate_draft else 0
        if self.compressor is not None and self.compressor.compact is not None:
            total += self.compressor.compact.nbytes
        return total


def build_engine(recipe: Recipe, target: LoadedModel, draft: LoadedModel | None = None, *,
                 sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 agree: Callable[[int], int] | None = None,
                 on_round: Callable[[RoundRecord], None] | None = None,
                 stores: tuple[PrefixStore | None, PrefixStore | None] | None = None) -> Scheduler:
    """The scheduler for `recipe` over a loaded target (and a separate draft model, if given).

    stores: prefix K/V stores to use (the target's, a separate draft's), e.g. kept across engines by
    `bench`; None: new ones as `batch.prefix_reuse` / `batch.prefix_cache` say.
    """
    _, capacity = slot_capacity(recipe, target.max_context)
    slots = recipe.batch.size
    target_runner = ModelRunner(target, slots=slots, capacity=capacity)
    draft_runner = None
    if recipe.draft.method != "none":
        if draft is not None:
            check_same_tokenizer(target, draft)
            draft_runner = ModelRunner(draft, slots=slots, capacity=capacity)
        else:
            draft_runner = target_runner
    if stores is None:
        batch = recipe.batch
        separate = draft_runner is not None and draft_runner is not target_runner
        stores = tuple(PrefixStore.for_cache(runner.cache, block=batch.prefix_block, capacity=batch.prefix_cache)
                       if batch.prefix_reuse and runner is not None else None
                       for runner in (target_runner, draft_runner if separate else None))
    for store, runner in zip(stores, (target_runner, draft_runner)):
        assert store is None or store.fits(runner.cache), "a prefix store serves caches of its own geometry"
    stats = EngineStats()
    decoder = SpeculativeDecoder(recipe, target_runner, draft_runner, stats, sync=sync, agree=agree, stores=stores)
    return Scheduler(recipe, target, decoder, stats, on_round=on_round)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A separate draft must speak the target's tokens: same vocabulary, token for token."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise JobError(f"draft.model: {draft.name} has a vocabulary of {draft.config.vocab_size} tokens, "
                       f"the target {target.name} has {target.config.vocab_size}; they must share a tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise JobError(f"draft.model: {draft.name} does not share the tokenizer of {target.name}")
