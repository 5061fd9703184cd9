"""One decoding round over every active row: draft gamma tokens, verify gamma + 1, accept, roll back.

Drafting runs gamma batched forwards of the draft (the target's own weights reading a compressor's
view of the target cache, or a separate model reading a view of its own cache); verification is one
target forward of the pending token plus the drafts. Each row then keeps its own accepted prefix
and the target's next token, both caches are cut back to what that row committed, and the row's own
stopping rules cut the emitted tokens (so one row's EOS never stops another). Every row drafts and
verifies under its own sampling parameters (`BatchSampling`: greedy rows by argmax and matching,
sampled rows with their own warping of q and p). gamma = 0 is plain decoding through the very same
path. Scheduling and prefill live in `engine.core`; the decoder that
chooses gamma and drives these rounds is `engine.spec.decoder`.
"""

from __future__ import annotations

import time

import torch

from engine.core.attention import ForwardBatch
from engine.spec.compressors.base import Compressor
from engine.core.runner import ModelRunner
from engine.core.sampling import BatchSampling
from engine.core.sequence import Sequence
from engine.core.stats import EngineStats
from engine.spec.verification import verify_rows


class RoundRunner:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, compressor: Compressor | None,
                 stats: EngineStats, sync=None, draft_forward=None):
        """draft_forward: the draft step (with a draft), (tokens [B, T], ForwardBatch) -> last-token
        logits [B, vocab]: `engine.draft_forward`."""
        self.target = target
        self.draft = draft
        self.draft_forward = draft_forward
        self.compressor = compressor
        self.self_speculation = draft is target
        self.stats = stats
        self.sync = sync or (lambda t: t)  # tensor parallel: make every rank use rank 0's tokens

    def choose(self, logits: torch.Tensor, sampling: BatchSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next tokens [B] from logits [B, vocab], each row under its own parameters, and the sampled
        rows' probs [B, vocab] (None when every row is greedy)."""
        tokens, probs = sampling.choose(logits)
        return self.sync(tokens), probs

    def run(self, seqs: list[Sequence], gamma: int, *, refresh_view: bool = False) -> tuple[float, float, float, list[int]]:
        """Advance every row by one round; returns (draft seconds, verify seconds, seconds of the
        selection after verification (a guided view), accepted per row). refresh_view: a plain round
        whose forward also re-selects a guided view (self-speculation), because the next round drafts."""
        device = self.target.device
        cache = self.target.cache
        slots = [s.slot for s in seqs]
        lengths = [cache.lengths[slot] for slot in slots]  # committed positions before the round
        pending = torch.tensor([s.pending_token for s in seqs], dtype=torch.long, device=device)  # [B]
        sampling = BatchSampling.of(seqs, device)

        # A guided draft re-selects its view from the attention mass of this round's full-cache forward:
        # speculative rounds (every one or every few, `draft.reselect_every`), and a plain round that
        # the decoder says comes right before a speculative one (otherwise its view is not read).
        observes = bool(gamma) and self.compressor is not None and self.compressor.observes_round()
        observes = observes or (refresh_view and not gamma and self.self_speculation)
        t0 = time.perf_counter()
        drafts, draft_probs = ([], [])
        if gamma:
            drafts, draft_probs = self._draft(seqs, slots, lengths, pending, gamma, sampling, observes)
        self._wait(device)
        t1 = time.perf_counter()

        tokens = torch.stack([pending, *drafts], dim=1)  # [B, gamma + 1]
        mass = None
        if observes and self.self_speculation:  # the target's verification is the full-cache forward
            mass = self.compressor.new_mass(len(seqs), max(lengths) + gamma + 1)  # [layers, B, kv_heads, N]
        batch = ForwardBatch(cache, slots, lengths, gamma + 1, mass=mass)
        logits = self.target.forward(tokens, batch)  # [B, gamma + 1, vocab]
        draft_tokens = tokens[:, 1:]  # [B, gamma]
        q = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, gamma, vocab]
        accepted, next_token = verify_rows(logits, q, draft_tokens, sampling)
        accepted, next_token = self.sync(accepted), self.sync(next_token)
        self._wait(device)
        t2 = time.perf_counter()

        accepted_list = accepted.tolist()
        draft_rows = draft_tokens.tolist()
        next_list = next_token.tolist()
        emitted = 0
        going: list[int] = []  # rows still generating
        for b, seq in enumerate(seqs):
            a = accepted_list[b]
            emitted += seq.extend(draft_rows[b][:a] + [next_list[b]])
            committed = lengths[b] + 1 + a  # the pending token and the accepted drafts
            cache.set_length(seq.slot, committed)
            if self.draft is not None and not self.self_speculation:
                # The draft recomputes its newest committed position at the start of every round.
                self.draft.cache.set_length(seq.slot, committed - 1)
            if self.compressor is not None and not seq.finished:
                self.compressor.committed(seq.slot, self.draft.cache.lengths[seq.slot])
                going.append(b)
        select_s = 0.0
        if mass is not None:
            t3 = time.perf_counter()
            committed = [cache.lengths[slots[b]] for b in going]
            # The next round's first draft forward reads the view up to the pending token, at `committed`.
            self.compressor.observe_mass(mass, going, [slots[b] for b in going], [n + 1 for n in committed],
                                         committed, gamma + 1)
            select_s = time.perf_counter() - t3
        self.stats.record_round(gamma=gamma, rows=len(seqs), accepted=accepted_list if gamma else [],
                                emitted=emitted)
        draft_s, verify_s = t1 - t0, t2 - t1
        self.stats.draft_s += draft_s
        self.stats.verify_s += verify_s
        if self.compressor is not None:
            selection = self.compressor.timer.take()
            self.stats.select_s += selection
            self.stats.round_select_s += selection
        return draft_s, verify_s, select_s, accepted_list

    @staticmethod
    def _wait(device: torch.device) -> None:
        """On a GPU, let queued kernels finish so the draft/verify timings (and gamma) are true."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _draft(self, seqs, slots, lengths, pending, gamma, sampling: BatchSampling, observes: bool):
        """gamma draft tokens per row: lists of [B] tokens and (when sampling) [B, vocab] probs.
        observes: a guided separate draft's first forward reads its whole cache and re-selects."""
        assert self.draft is not None and self.compressor is not None, "speculation needs a draft"
        device = pending.device
        if self.self_speculation:
            # The draft writes its (approximate) K/V for the speculative positions into the target
            # cache, past the committed length; verification overwrites exactly those positions.
            current, starts = pending[:, None], list(lengths)
        else:
            previous = torch.tensor([s.last_context_token for s in seqs], dtype=torch.long, device=device)
            current, starts = torch.stack([previous, pending], dim=1), [n - 1 for n in lengths]
        drafts, probs = [], []
        for step in range(gamma):
            width = current.shape[1]
            ends = [s + width for s in starts]
            if step == 0 and not self.self_speculation and observes:
                # A guided separate draft: its first forward of the round (the newest committed token
                # and the pending one) reads its whole cache, and the view it reads next comes from
                # that forward's attention mass.
                mass = self.compressor.new_mass(len(seqs), max(ends))  # [layers, B, kv_heads, N]
                logits = self.draft_forward(current, ForwardBatch(self.draft.cache, slots, starts, width, mass=mass))
                self.compressor.observe_mass(mass, list(range(len(seqs))), slots, [e + 1 for e in ends], ends, width)
            else:
                batch = ForwardBatch(self.draft.cache, slots, starts, width, view=self.compressor.view(slots, ends))
                logits = self.draft_forward(current, batch)  # [B, vocab]
            token, p = self.choose(logits, sampling)
            drafts.append(token)
            if p is not None:
                probs.append(p)
            current, starts = token[:, None], ends
        return drafts, probs
