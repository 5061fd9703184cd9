"""Continuous batching of requests over fixed KV-cache slots: admission, prefill, rounds, results.

`Scheduler.run(requests)` pulls tokenised requests lazily, keeps a bounded look-ahead ordered by
prompt length, admits a request into every free slot (its prompt prefilled into every cache the
decoder keeps, see `engine.core.prefill`), then asks the `Decoder` for one round at a time over all
active rows, and yields each `Result` the moment its row finishes, refilling the slot at once. Rows
that cannot fit a slot come back as error results.

How tokens are produced after prefill is the decoder's business: MagicDec's speculative rounds (and
plain decoding, their gamma = 0 case) live in `engine.spec`, which builds a Scheduler around its
decoder (`engine.spec.decoder.build_engine`). This module does not read files, format prompts,
write output, or know what a draft is.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Callable, Iterable, Iterator, Protocol

import torch

from engine.config.schema import Recipe, slot_capacity
from engine.core.prefill import RowPrefill, SlotListener, prefill_rows, shared_blocks
from engine.core.prefix_store import PrefixStore
from engine.core.runner import ModelRunner
from engine.core.sampling import ROW_SEED_ONLY, row_generator
from engine.core.sequence import Request, Result, Sequence, error_result
from engine.core.stats import EngineStats
from engine.models.loading import LoadedModel


@dataclasses.dataclass
class PrefillTarget:
    """A model whose cache holds every admitted row's prompt, who listens to its slots, and the store
    of prefix K/V its rows may reuse."""

    runner: ModelRunner
    listener: SlotListener | None = None
    store: PrefixStore | None = None


@dataclasses.dataclass
class RoundRecord:
    """What one decoding round did, for observers (`bench` keeps steady-state figures from these)."""

    rows: int  # active rows in the round
    gamma: int  # draft tokens per row (0: plain decoding)
    seconds: float  # the whole round
    draft_s: float
    verify_s: float
    emitted: int  # tokens the rows kept
    select_s: float = 0.0  # a selection after verification (the guided view's), not in draft_s / verify_s


class Decoder(Protocol):
    """How the active rows advance after prefill (implemented by `engine.spec.decoder`)."""

    prefill_targets: list[PrefillTarget]  # the target's cache first

    def start(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Rows just prefilled: emit each one's first token from its prompt's last logits [B, vocab]."""

    def step(self, seqs: list[Sequence]) -> RoundRecord:
        """One round over every active row (each row's stop rules applied)."""

    def release(self, slot: int) -> None:
        """The row in `slot` finished: forget whatever the decoder keeps for it."""


PREFILL, DECODE = "prefill", "decode"  # what `Scheduler.on_phase` is told is about to run


class Scheduler:
    def __init__(self, recipe: Recipe, target: LoadedModel, decoder: Decoder, stats: EngineStats,
                 *, on_round: Callable[[RoundRecord], None] | None = None,
                 on_phase: Callable[[str], None] | None = None):
        """target: the loaded target model; decoder.prefill_targets[0].runner must be its runner.

        on_round: told what each round did, after it. on_phase: called with PREFILL before every
        prefill chunk and with DECODE before every round, so an observer (the job's timeline) can
        look at the clock and at `stats` between two pieces of work, whatever their length.
        """
        self.recipe = recipe
        self.target_model = target
        self.decoder = decoder
        self.stats = stats
        self.on_round = on_round
        self.on_phase = on_phase
        self.target = decoder.prefill_targets[0].runner
        self.max_len, _ = slot_capacity(recipe, target.max_context)
        self.free_slots = list(range(recipe.batch.size))
        self.active: list[Sequence] = []

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Generate for every request; results are yielded as rows finish (any order)."""
        waiting = LookaheadQueue(requests, self.recipe.batch.lookahead, by_prefix=self.recipe.batch.prefix_reuse)
        while True:
            wave, errors = self.next_wave(waiting)
            yield from errors
            if wave:
                for seq in self.admit(wave):
                    if seq.finished:
                        yield self.release(seq)
            if not self.active:
                if not waiting:
                    return
                continue
            if self.on_phase is not None:
                self.on_phase(DECODE)
            record = self.decoder.step(self.active)
            if self.on_round is not None:
                self.on_round(record)
            for seq in [s for s in self.active if s.finished]:
                yield self.release(seq)

    def next_wave(self, waiting: "LookaheadQueue") -> tuple[list[Request], list[Result]]:
        """The requests to admit together into the free slots, and error results for those that cannot run.

        With prefix reuse a wave ends before a row that shares more full blocks with a row already in
        it than the store holds of its prompt: that row is prefilled in the next wave, once the first
        one's prefix is in the store. (Not merely its first block: rows of different documents that
        all start with one chat-template header would otherwise join a wave once the header is stored,
        and compute their shared document side by side.)
        """
        wave, errors = [], []
        store = self.decoder.prefill_targets[0].store
        while len(wave) < len(self.free_slots) and waiting:
            request = waiting.peek()
            if store is not None and wave:
                stored = store.stored_blocks(request.prompt_ids)
                if any(shared_blocks(request.prompt_ids, other.prompt_ids, store.block) > stored for other in wave):
                    break
            waiting.pop()
            problem = slot_problem(request, self.max_len)
            if problem:
                errors.append(error_result(request, problem))
            else:
                wave.append(request)
        return wave, errors

    def admit(self, requests: list[Request]) -> list[Sequence]:
        """Prefill a wave of requests into free slots (packed), emit their first tokens; returns their rows."""
        seqs = []
        for request in requests:
            slot = self.free_slots.pop(0)
            sampling = request.sampling or self.recipe.sampling
            generator = None
            if not sampling.greedy:  # a row's samples depend on its seed (and id), never on its slot or batch
                generator = row_generator(sampling.seed, ROW_SEED_ONLY if request.own_seed else request.id,
                                          self.target.device)
            seqs.append(Sequence(request, slot, max_len=self.max_len, eos_ids=self.target_model.eos_token_ids,
                                 sampling=sampling, tokenizer=self.target_model.tokenizer,
                                 generator=generator))
        clock = [time.perf_counter()]

        def chunk_starts() -> None:  # prefill time is counted as it passes, so an observer sees it grow
            now = time.perf_counter()
            self.stats.prefill_s += now - clock[0]
            clock[0] = now
            if self.on_phase is not None:
                self.on_phase(PREFILL)

        logits = None
        for index, target in enumerate(self.decoder.prefill_targets):
            rows = [RowPrefill(seq.slot, seq.request.prompt_ids) for seq in seqs]
            prefill_rows(target.runner, rows, self.recipe.batch.prefill_chunk, target.listener, target.store,
                         on_chunk=chunk_starts)
            if index == 0:  # the target's own: the tokens the job computed or reused
                logits = torch.stack([row.logits for row in rows])  # [B, vocab]
                reused = sum(row.reused for row in rows)
                self.stats.prefill_tokens += sum(seq.prompt_len for seq in seqs) - reused
                self.stats.prefill_tokens_reused += reused
        self.stats.prefill_s += time.perf_counter() - clock[0]
        self.decoder.start(seqs, logits)
        self.active.extend(seqs)
        return seqs

    def release(self, seq: Sequence) -> Result:
        self.active.remove(seq)
        self.target.cache.clear(seq.slot)
        self.decoder.release(seq.slot)
        self.free_slots.append(seq.slot)
        return seq.result()


def slot_problem(request: Request, max_len: int) -> str | None:
    """Why a request cannot run in a slot of `max_len` tokens (prompt + output), or None."""
    n = len(request.prompt_ids)
    if n == 0:
        return "the prompt is empty (0 tokens)"
    need = n + request.max_new_tokens
    if need > max_len:
        return (f"prompt has {n} tokens; with max_new_tokens {request.max_new_tokens} it needs {need} "
                f"> batch.max_len {max_len} (raise batch.max_len or set prompt.truncate: left)")
    return None


class LookaheadQueue:
    """Reads at most `size` requests ahead of admission and hands them out in a useful order.

    by_prefix (prefix reuse on): in token order, so rows sharing a prefix come out one after the other
    and the first of them fills the prefix store for the rest; else the longest prompt first, which
    keeps rows of similar length running together (their KV reads and finishing times line up).
    Either way no more than `size` rows are held in memory.
    """

    def __init__(self, requests: Iterable[Request], size: int, *, by_prefix: bool = False):
        self.source = iter(requests)
        self.size = size
        self.by_prefix = by_prefix
        self.heap: list[tuple[object, int, Request]] = []
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
            key = tuple(request.prompt_ids) if self.by_prefix else -len(request.prompt_ids)
            heapq.heappush(self.heap, (key, next(self.counter), request))

    def __bool__(self) -> bool:
        return bool(self.heap)

    def peek(self) -> Request:
        return self.heap[0][2]

    def pop(self) -> Request:
        request = heapq.heappop(self.heap)[2]
        self._fill()
        return request
