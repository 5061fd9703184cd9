"""The generation engine: continuous batching of requests over fixed KV-cache slots.

`Engine.run(requests)` pulls tokenised requests lazily, keeps a bounded look-ahead ordered by prompt
length, admits a request into every free slot (chunked prefill of the target, and of a separate
draft model if there is one, then the compressor's prefill-time selection), runs decoding rounds
(`speculative.RoundRunner`) with the gamma the policy picks, and yields each `Result` the moment its
row finishes, refilling the slot at once. Rows that cannot fit a slot come back as error results.
It does not read files, format prompts or write output (see `engine.job`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Iterable, Iterator

import torch

from engine.attention import ForwardBatch
from engine.config import Recipe
from engine.draft_forward import LeanDraft, ModuleDraft, draft_forward_for
from engine.errors import JobError
from engine.gamma import GammaPolicy
from engine.kv.base import Compressor
from engine.kv.pqcache import PQCache
from engine.kv.snapkv import SnapKV, WindowObserver
from engine.kv.streamingllm import StreamingLLM
from engine.models import LoadedModel
from engine.runner import ModelRunner
from engine.sampling import row_generator
from engine.sequence import Request, Result, Sequence, error_result
from engine.speculative import RoundRunner
from engine.stats import EngineStats

COMPRESSORS: dict[str, type[Compressor]] = {"streamingllm": StreamingLLM, "snapkv": SnapKV, "pqcache": PQCache}


def round_scratch(recipe: Recipe) -> int:
    """Positions one round may write past a row's committed length: gamma_max + 1 (0 without a draft)."""
    if recipe.draft.method == "none":
        return 0
    gamma = recipe.spec.gamma
    return (gamma if isinstance(gamma, int) else recipe.spec.gamma_max) + 1


def slot_capacity(recipe: Recipe, max_context: int) -> tuple[int, int]:
    """(max_len, physical capacity): max_len tokens per row, plus scratch for one round's drafts."""
    max_len = recipe.batch.max_len or max_context
    return max_len, max_len + max(round_scratch(recipe), 1)


class Engine:
    def __init__(self, recipe: Recipe, target: LoadedModel, draft: LoadedModel | None = None,
                 *, sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 agree: Callable[[int], int] | None = None):
        """sync: makes every tensor-parallel rank use rank 0's token tensors; agree: the same for
        a Python int (the gamma each round, which rank 0 picks from its own timings)."""
        self.recipe = recipe
        self.target_model = target
        self.max_len, capacity = slot_capacity(recipe, target.max_context)
        slots = recipe.batch.size
        self.stats = EngineStats()
        self.target = ModelRunner(target, slots=slots, capacity=capacity)
        method = recipe.draft.method
        self.draft: ModelRunner | None = None
        self.compressor: Compressor | None = None
        if method != "none":
            if draft is not None:
                check_same_tokenizer(target, draft)
                self.draft = ModelRunner(draft, slots=slots, capacity=capacity)
            else:
                self.draft = self.target
            self.compressor = COMPRESSORS[method](recipe.draft, self.draft.cache, self.draft.heads)
        self.draft_forward: LeanDraft | ModuleDraft | None = None  # the draft step (its GEMM dtype, its path)
        if self.draft is not None:
            self.draft_forward = draft_forward_for(recipe.draft.linear_dtype, self.draft, self.compressor,
                                                   extra=round_scratch(recipe),
                                                   self_speculation=self.draft is self.target)
        self.rounds = RoundRunner(self.target, self.draft, self.compressor, recipe.sampling, self.stats, sync,
                                  self.draft_forward)
        self.policy = GammaPolicy(recipe.spec.gamma, recipe.spec.gamma_max, recipe.spec.replan_every,
                                  speculative=method != "none")
        self.agree = agree or (lambda value: value)
        self.free_slots = list(range(slots))
        self.active: list[Sequence] = []

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Generate for every request; results are yielded as rows finish (any order)."""
        waiting = LookaheadQueue(requests, self.recipe.batch.lookahead)
        while True:
            while self.free_slots and waiting:
                request = waiting.pop()
                problem = self.check_fits(request)
                if problem:
                    yield error_result(request, problem)
                    continue
                seq = self.admit(request)
                if seq.finished:
                    yield self.release(seq)
            if not self.active:
                if not waiting:
                    return
                continue
            gamma = self.agree(self.policy.next_gamma())
            t0 = time.perf_counter()
            draft_s, verify_s, accepted = self.rounds.run(self.active, gamma)
            self.stats.decode_s += time.perf_counter() - t0
            self.policy.observe(gamma=gamma, rows=len(self.active), draft_s=draft_s, verify_s=verify_s,
                                accepted=accepted)
            for seq in [s for s in self.active if s.finished]:
                yield self.release(seq)

    def check_fits(self, request: Request) -> str | None:
        n = len(request.prompt_ids)
        if n == 0:
            return "the prompt is empty (0 tokens)"
        need = n + request.max_new_tokens
        if need > self.max_len:
            return (f"prompt has {n} tokens; with max_new_tokens {request.max_new_tokens} it needs {need} "
                    f"> batch.max_len {self.max_len} (raise batch.max_len or set prompt.truncate: left)")
        return None

    # ------------------------------------------------------------------ slots

    def admit(self, request: Request) -> Sequence:
        slot = self.free_slots.pop(0)
        sampling = self.recipe.sampling
        generator = None
        if not sampling.greedy:
            generator = row_generator(sampling.seed, request.id, self.target.device)
        seq = Sequence(request, slot, max_len=self.max_len, eos_ids=self.target_model.eos_token_ids,
                       stop_strings=sampling.stop, tokenizer=self.target_model.tokenizer, generator=generator)
        logits = self.prefill(self.target, seq, self.compressor if self.draft is self.target else None)
        if self.draft is not None and self.draft is not self.target:
            self.prefill(self.draft, seq, self.compressor)
            self.draft.cache.set_length(slot, seq.prompt_len - 1)  # see RoundRunner: recomputed each round
        first, _ = self.rounds.choose(logits, [seq])
        seq.extend([int(first[0])])
        self.active.append(seq)
        return seq

    def prefill(self, runner: ModelRunner, seq: Sequence, compressor: Compressor | None) -> torch.Tensor:
        """Chunked prefill of one row into its slot; returns the last position's logits [1, vocab]."""
        t0 = time.perf_counter()
        ids = seq.request.prompt_ids
        n = len(ids)
        chunk = self.recipe.batch.prefill_chunk
        observer = None
        if compressor is not None and compressor.observe_window:
            window = min(compressor.observe_window, n)
            observer = WindowObserver(runner.layers, runner.heads, window, runner.head_dim, n - window,
                                      runner.device, runner.loaded.dtype)
        runner.cache.clear(seq.slot)
        tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
        logits = None
        for start in range(0, n, chunk):
            piece = tokens[start: start + chunk]
            batch = ForwardBatch(runner.cache, [seq.slot], [start], len(piece), observer=observer)
            logits = runner.forward(piece[None], batch, last_only=True)[:, -1]
        runner.cache.set_length(seq.slot, n)
        if compressor is not None:
            compressor.prefill_done(seq.slot, n, observer.queries if observer is not None else None)
            self.stats.select_s += compressor.timer.take()
        if runner is self.target:
            self.stats.prefill_tokens += n
        self.stats.prefill_s += time.perf_counter() - t0
        return logits

    def release(self, seq: Sequence) -> Result:
        self.active.remove(seq)
        self.target.cache.clear(seq.slot)
        if self.draft is not None and self.draft is not self.target:
            self.draft.cache.clear(seq.slot)
        if self.compressor is not None:
            self.compressor.release(seq.slot)
        self.free_slots.append(seq.slot)
        return seq.result()


class LookaheadQueue:
    """Reads at most `size` requests ahead of admission and hands out the longest prompt first.

    Longest-first inside a bounded window keeps rows of similar length running together (their
    KV reads and finishing times line up) without ever holding more than `size` rows in memory.
    """

    def __init__(self, requests: Iterable[Request], size: int):
        self.source = iter(requests)
        self.size = size
        self.heap: list[tuple[int, int, Request]] = []
        self.counter = itertools.count()
        self.exhausted = False
        self._fill()

    def _fill(self) -> None:
        while not self.exhausted and len(self.heap) < self.size:
            try:
                request = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            heapq.heappush(self.heap, (-len(request.prompt_ids), next(self.counter), request))

    def __bool__(self) -> bool:
        return bool(self.heap)

    def pop(self) -> Request:
        request = heapq.heappop(self.heap)[2]
        self._fill()
        return request


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A separate draft must speak the target's tokens: same vocabulary, token for token."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise JobError(f"draft.model: {draft.name} has a vocabulary of {draft.config.vocab_size} tokens, "
                       f"the target {target.name} has {target.config.vocab_size}; they must share a tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise JobError(f"draft.model: {draft.name} does not share the tokenizer of {target.name}")
