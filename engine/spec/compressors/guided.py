"""A verification-guided draft view: the positions the target's last verification attended to most.

The target's verification forward already computes attention over every row's whole cache for its
gamma + 1 queries; with `ForwardBatch.mass` it also returns each position's attention mass per layer
and KV head (summed over the GQA group's query heads and those queries; `engine.core.attention`).
After each round, per row, layer and KV head, this view keeps:

- the first `sink` positions (attention sinks),
- the newest `window` positions (sliding as the next round drafts), and
- the top `budget - sink - window` of the positions in between, [sink, L - window), by rank, where
  L is the end of the first draft forward that reads the view (the pending token's position + 1).
  A position's rank is its score where that reaches `draft.floor` x the uniform share (floor / (L -
  window) as a per-query probability), else its recency: the positions attention found go first, by
  score, then the newest of the faint ones. One verification has gamma + 1 queries per row, so below
  the bar its scores order the tail by noise, and recency is the better guess there (measured on the
  code prompts at gamma 3, budget 512: per-token acceptance 0.913 by score alone, 0.934 with floor 1,
  StreamingLLM 0.923; BENCHMARKS.md section 28). floor 0 ranks by score alone.

With `draft.reselect_every` k > 1 the view is chosen after every k-th speculative round only (the
verification of the rounds between returns no mass, and their drafts read the kept part as it was,
with the newest positions sliding as for SnapKV): the selection's cost and the mass's share of
verification are paid once per k rounds, against a view up to k rounds old. Under `gamma: auto` a
plain round's forward returns its mass too when the next round drafts (the decoder asks
`GammaPolicy.speculates_after_plain_round`), so a probe after plain rounds reads a view one round
old, not one chosen before them.

The score is the round's mass divided by the number of queries (group heads x tokens), so rounds of
different gamma weigh alike; with `draft.smoothing` s > 0 it is s x the previous score + (1 - s) x
this round's (positions past the committed length, rejected drafts, start again from 0). With
`draft.successors` n > 0 a position ranks by the highest score of itself and the n positions before
it: a head that copies (an induction head reading position p for this token reads p + 1 for the
next) reads next round the positions just after those it read in this one, which no query of this
round scored yet (the smoothed scores carried to the next round are the unraised ones). At prefill
the scores are SnapKV's: the prompt's last `window` queries' attention over the prompt, pooled with
`kernel_size` (`engine.spec.compressors.snapkv`), so the first round is already guided. A row whose
candidates number at most `budget - sink - window` keeps all of them, i.e. reads everything.

Where it comes from: self-speculation takes the target's verification mass; a separate draft model
(whose layers and heads are its own) takes its own: the first draft forward of each round, which
recomputes the newest committed token and reads the pending one, attends to the draft's whole cache
and returns the mass, and the round's later draft steps read the view chosen from it.

With the lean CPU draft the view lives in the draft's compact bf16 store: after each selection only
the kept entries whose position changed are copied from the target cache (a position that stays
keeps its entry), the ring of newest positions is refreshed as for the other methods (a row
shorter than the budget, whose kept count grows, has its ring moved after it:
`CompactStore.move_ring`). On CPU the selection and that refill run as one C++ op (`guided_select`,
engine/core/csrc/cpu_guided.cpp: a partial selection per (layer, row, KV head), not a sort);
elsewhere, or without a compiler, as torch ops (`carry_to_successors`, `select_top`, `_refill`). Both
are the rule above, and the tests hold each to a loop over positions. This module chooses positions;
it does not compute attention.
"""

from __future__ import annotations

import torch

from engine.core import kernels as cpu_kernels
from engine.spec.compressors.base import Compressor, FixedKeptView
from engine.spec.compressors.snapkv import pool_scores, prompt_window_scores


class Guided(Compressor):
    name = "guided"
    compact_store = True
    compact_ring_per_slot = True  # a short row's ring moves as its kept count grows (`_update`)
    wants_mass = True

    def __init__(self, config, cache, num_heads):
        super().__init__(config, cache, num_heads)
        self.observe_window = config.window
        self.sink, self.window = config.sink, config.window
        self.top = config.budget - config.sink - config.window  # positions chosen by score (validated > 0)
        self.keep = self.kept_entries(config)  # sink + top
        self.group = num_heads // cache.kv_heads
        layers, slots, kv_heads = cache.layers, cache.slots, cache.kv_heads
        # [layers, slots, kv_heads, keep]: each slot's kept positions (sinks first, then the chosen);
        # with a compact store, kept entry i of the store holds kept[..., i].
        self.kept = torch.zeros(layers, slots, kv_heads, self.keep, dtype=torch.long, device=cache.device)
        self.kept_count = torch.zeros(slots, dtype=torch.long, device=cache.device)  # [slots]
        self.kept_end = torch.zeros(slots, dtype=torch.long, device=cache.device)  # [slots]
        # [layers, slots, kv_heads, capacity]: the smoothed score of every position (smoothing > 0 only)
        self.scores = None
        if config.smoothing > 0:
            self.scores = torch.zeros(layers, slots, kv_heads, cache.capacity, dtype=torch.float32,
                                      device=cache.device)
        # [layers, slots, kv_heads]: each task's last selection threshold, the C++ op's starting pivot
        self.threshold = torch.zeros(layers, slots, kv_heads, dtype=torch.float32, device=cache.device)
        self.spec_rounds = 0  # speculative rounds so far (re-selection after every `reselect_every`-th)
        self.changed_entries = 0  # kept entries refilled from the cache (with a compact store), for the record
        self.selected_entries = 0  # kept entries chosen by the re-selections after rounds (prefill excluded)

    @staticmethod
    def kept_entries(config) -> int:
        return max(config.budget - config.window, 0)

    def enable_compact(self, *, extra: int, copy_committed: bool) -> bool:
        # A separate draft reads its whole cache at the start of each round, so its K/V stay there.
        return copy_committed and super().enable_compact(extra=extra, copy_committed=copy_committed)

    # ------------------------------------------------------------------ life cycle

    def prefill_done(self, slot: int, prompt_len: int, observed: torch.Tensor | None,
                     mass: torch.Tensor | None = None) -> None:
        """SnapKV's scores of the prompt start the slot: [layers, 1, kv_heads, prompt_len]. mass: the
        window's attention mass from the prefill itself, or None (computed here)."""
        assert observed is not None, "the guided draft starts from the observation window's queries"
        window = observed.shape[2]
        cache = self.cache
        with self.timer:
            if mass is None:
                mass = prompt_window_scores(observed, cache, slot, prompt_len)  # [layers, kv_heads, prompt_len]
            pooled = pool_scores(mass.reshape(-1, prompt_len), self.config.kernel_size, self.config.pooling)
            scores = (pooled / (self.group * window)).view(cache.layers, 1, cache.kv_heads, prompt_len)
            slots = torch.tensor([slot], dtype=torch.long, device=cache.device)
            self.kept_count[slot] = 0  # a new sequence: no kept entry holds anything yet
            if self.scores is not None:  # the smoothed scores start from these
                self.scores[:, slot] = 0
                self.scores[:, slot, :, :prompt_len] = scores[:, 0]
            self._update(slots, scores, [prompt_len + 1], [prompt_len], start=True)
        if self.compact is not None:
            count = int(self.kept_count[slot])
            self.compact.fill(slot, self.kept[:, slot, :, :count], int(self.kept_end[slot]), prompt_len)

    def observes_round(self) -> bool:
        """Whether this speculative round's full-cache forward returns its mass: every
        `reselect_every`-th round, the first one included."""
        due = self.spec_rounds % self.config.reselect_every == 0
        self.spec_rounds += 1
        return due

    def new_mass(self, rows: int, positions: int) -> torch.Tensor:
        """A buffer for one forward's attention mass: [layers, rows, kv_heads, positions] (written in full)."""
        cache = self.cache
        return torch.empty(cache.layers, rows, cache.kv_heads, positions, dtype=torch.float32, device=cache.device)

    def observe_mass(self, mass: torch.Tensor, rows: list[int], slots: list[int], ends: list[int],
                     committed: list[int], tokens: int) -> None:
        """A forward over the whole cache returned mass [layers, B, kv_heads, N]; re-select for `rows`
        of it (their slots), whose next draft forward reading the view ends at ends[i], with committed[i]
        positions committed. tokens: new tokens per row in that forward."""
        if not rows:
            return
        device = self.cache.device
        with self.timer:
            index = torch.tensor(rows, dtype=torch.long, device=device)
            if len(rows) < mass.shape[1]:
                mass = mass.index_select(1, index)
            scale = 1.0 / (self.group * tokens)  # to the mean probability per query: rounds of any gamma alike
            scores = mass * scale if self.scores is not None else mass  # [layers, B, kv_heads, N]
            self._update(torch.tensor(slots, dtype=torch.long, device=device), scores, ends, committed,
                         start=False, scale=1.0 if self.scores is not None else scale)

    # ------------------------------------------------------------------ selection

    def _update(self, slots: torch.Tensor, scores: torch.Tensor, ends: list[int], committed: list[int], *,
                start: bool, scale: float = 1.0) -> None:
        """Smooth, select and store the view of `slots` [B] from scores [layers, B, kv_heads, N], and
        bring the compact store's kept entries up to date (start: a prefill, which is neither smoothed
        nor refilled here: `prefill_done` fills the store). scale: scores x scale are per-query
        probabilities (only used to compare selection thresholds across rounds)."""
        device = scores.device
        N = scores.shape[-1]
        if self.scores is not None and not start:
            s = self.config.smoothing
            previous = self.scores[:, slots, :, :N]  # [layers, B, kv_heads, N] (a copy)
            scores = previous.mul_(s).add_(scores, alpha=1.0 - s)
            stale = torch.arange(N, device=device)[None, :] >= torch.tensor(committed, device=device)[:, None]
            scores.masked_fill_(stale[None, :, None, :], 0.0)  # [B, N]: positions to be rewritten
            self.scores[:, slots, :, :N] = scores
        ends_t = torch.tensor(ends, dtype=torch.long, device=device)
        refill = self.compact is not None and not start
        old_count = self.kept_count.index_select(0, slots) if refill else None  # [B]
        successors = 0 if start else self.config.successors  # a prefill's scores are pooled already
        kernel = cpu_kernels.load() if device.type == "cpu" else None
        if kernel is not None:
            kept_end = (ends_t - self.window).clamp(min=0)
            count = kept_end.clamp(max=self.sink) + (kept_end - self.sink).clamp(min=0, max=self.top)
            store = (self.compact.k, self.compact.v, self.cache.k, self.cache.v) if refill else (None,) * 4
            hint = self.threshold[:, slots]  # [layers, B, kv_heads]: last round's thresholds (a speed-up)
            self.changed_entries += kernel.guided_select(scores.contiguous(), slots, kept_end,
                                                         self.kept_count.index_select(0, slots), self.kept,
                                                         hint, scale, self.config.floor, self.sink, self.top,
                                                         successors, *store)
            self.threshold[:, slots] = 0.0 if start else hint
            if refill:
                self._mark_kept_entries(slots, count)
        else:
            if successors > 0:
                scores = carry_to_successors(scores, successors)
            if self.config.floor > 0:
                scores = rank_faint_by_recency(scores, (ends_t - self.window).clamp(min=0), self.config.floor / scale)
            kept, count, kept_end = select_top(scores, ends_t, sink=self.sink, window=self.window, top=self.top)
            if refill:
                kept = self._refill(slots, kept, count)
            self.kept[:, slots, :, : kept.shape[-1]] = kept
        self.kept_count[slots] = count
        self.kept_end[slots] = kept_end
        if refill:
            # Rows shorter than the budget keep more positions as they grow: their rings move up.
            for b in (count != old_count).nonzero().flatten().tolist():
                self.compact.move_ring(int(slots[b]), int(count[b]), committed[b])
        if not start:
            self.selected_entries += int(count.sum()) * self.cache.layers * self.cache.kv_heads

    def _refill(self, slots: torch.Tensor, kept: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Arrange the new kept positions so that a position kept before keeps its store entry, copy
        the K/V of the others into the entries they take; returns the arranged kept [layers, B, kv_heads, K]."""
        layers, B, kv_heads, K = kept.shape
        old = self.kept[:, slots, :, :K]  # [layers, B, kv_heads, K]
        old_count = self.kept_count[slots]  # [B]
        entry = torch.arange(K, device=kept.device)
        new_valid = (entry[None, :] < count[:, None])[None, :, None, :].expand_as(kept)
        old_valid = (entry[None, :] < old_count[:, None])[None, :, None, :].expand_as(kept)
        G = layers * B * kv_heads
        width = int(torch.maximum(kept.max(), old.max())) + 2 if K else 1  # positions + one "invalid" column
        flat_new, flat_old = kept.reshape(G, K), old.reshape(G, K)
        dump = width - 1
        in_new = torch.zeros(G, width, dtype=torch.bool, device=kept.device)
        in_new.scatter_(1, torch.where(new_valid.reshape(G, K), flat_new, dump), True)
        in_old = torch.zeros(G, width, dtype=torch.bool, device=kept.device)
        in_old.scatter_(1, torch.where(old_valid.reshape(G, K), flat_old, dump), True)
        in_new[:, dump] = in_old[:, dump] = False
        stays = old_valid.reshape(G, K) & in_new.gather(1, flat_old)  # [G, K]: old entries still chosen
        fresh = new_valid.reshape(G, K) & ~in_old.gather(1, flat_new)  # [G, K]: chosen positions not held
        free = new_valid.reshape(G, K) & ~stays  # entries that take them (as many per row as fresh ones)
        arranged = flat_old.clone()
        free_g, free_i = free.nonzero(as_tuple=True)  # row-major: per g, ascending entries...
        fresh_g, fresh_j = fresh.nonzero(as_tuple=True)  # ...paired with its fresh positions in order
        assert torch.equal(free_g, fresh_g), "a row has as many free entries as new positions"
        arranged[free_g, free_i] = flat_new[fresh_g, fresh_j]
        if free_g.numel():
            layer, rest = free_g // (B * kv_heads), free_g % (B * kv_heads)
            self.compact.refill(layer, slots[rest // kv_heads], rest % kv_heads, free_i, arranged[free_g, free_i])
        self.changed_entries += int(free_g.numel())
        self._mark_kept_entries(slots, count)
        return arranged.view(layers, B, kv_heads, K)

    def _mark_kept_entries(self, slots: torch.Tensor, count: torch.Tensor) -> None:
        """The store's first count[b] entries of each slot are kept positions (recorded as 0: they
        precede every query)."""
        shown = torch.arange(self.keep, device=slots.device)[None, :] < count[:, None]  # [B, keep]
        entries = self.compact.entry_pos.index_select(0, slots)[:, : self.keep]
        self.compact.entry_pos[slots, : self.keep] = torch.where(shown, torch.zeros_like(entries), entries)

    def view(self, slots: list[int], ends: list[int]) -> FixedKeptView:
        device = self.cache.device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        return FixedKeptView(lambda layer: self.kept[layer].index_select(0, index),
                             self.kept_count.index_select(0, index), self.kept_end.index_select(0, index),
                             torch.tensor(ends, dtype=torch.long, device=device), self.budget, self.timer,
                             layer_invariant=False, slots=index, compact=self.compact)


def rank_faint_by_recency(scores: torch.Tensor, kept_end: torch.Tensor, floor: float) -> torch.Tensor:
    """scores [layers, B, kv_heads, N] with each position under floor / kept_end[b] (floor x the uniform
    share, in the scores' units) replaced by a value under that bar that grows with the position, so a
    top-k takes the positions above the bar by score, then the newest of the rest."""
    N = scores.shape[-1]
    length = kept_end.clamp(min=1).to(torch.float32)  # [B]
    bar = (floor / length)[:, None]  # [B, 1]
    positions = torch.arange(N, device=scores.device, dtype=torch.float32)[None, :]  # [1, N]
    recency = bar * (positions + 1) / (length[:, None] + 2)  # [B, N]: under the bar for p < kept_end
    return torch.where(scores < bar[None, :, None, :], recency[None, :, None, :], scores)


def carry_to_successors(scores: torch.Tensor, successors: int) -> torch.Tensor:
    """scores [..., N] with each position's score raised to the highest of itself and the `successors`
    positions before it (a one-sided running maximum; the torch twin of the C++ op's raise)."""
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    padded = torch.nn.functional.pad(flat, (successors, 0))
    return torch.nn.functional.max_pool1d(padded, successors + 1, stride=1).view(shape)


def select_top(scores: torch.Tensor, ends: torch.Tensor, *, sink: int, window: int,
               top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The guided rule for rows whose next view-reading forward ends at ends [B].

    scores: [layers, B, kv_heads, N] (N >= ends - window). Row b keeps [0, min(sink, kept_end)) and
    the top min(top, kept_end - sink) of [sink, kept_end) by score, kept_end = max(ends - window, 0).
    Returns kept [layers, B, kv_heads, sink + k] (the first count[b] entries of row b are its kept
    positions, sinks first; k = min(top, max(kept_end) - sink)), count [B] and kept_end [B].
    """
    layers, B, kv_heads, N = scores.shape
    device = scores.device
    kept_end = (ends - window).clamp(min=0)  # [B]
    candidates = (kept_end - sink).clamp(min=0)  # [B]
    count = torch.clamp(kept_end, max=sink) + candidates.clamp(max=top)  # [B]
    highest = int(kept_end.max()) if B else 0
    k = min(top, max(highest - sink, 0))
    sinks = torch.arange(sink, device=device).expand(layers, B, kv_heads, sink)
    if k == 0:
        return sinks.clone(), count, kept_end
    region = scores[..., sink:highest]  # [layers, B, kv_heads, highest - sink]
    outside = torch.arange(sink, highest, device=device)[None, :] >= kept_end[:, None]  # [B, highest - sink]
    region = region.masked_fill(outside[None, :, None, :], float("-inf"))
    chosen = region.topk(k, dim=-1, sorted=False).indices + sink  # [layers, B, kv_heads, k]
    # Rows with at most `top` candidates keep them all: [sink, kept_end) in order.
    every = (candidates <= top)[None, :, None, None]
    chosen = torch.where(every, torch.arange(sink, sink + k, device=device).expand_as(chosen), chosen)
    return torch.cat([sinks, chosen], dim=-1), count, kept_end
