"""StreamingLLM (Xiao et al. 2023) as a draft view: the first `sink` tokens plus the newest ones.

Static: no search and no per-slot state; the same positions for every layer and KV head. With
`budget` entries and `sink` sinks the draft reads [0, sink) and the newest `budget - sink` positions.
"""

from __future__ import annotations

import torch

from engine.spec.compressors.base import Compressor, FixedKeptView


class StreamingLLM(Compressor):
    name = "streamingllm"
    compact_store = compact_sinks = True

    @staticmethod
    def kept_entries(config) -> int:
        return min(config.sink, config.budget)

    def prefill_done(self, slot: int, prompt_len: int, observed, mass=None) -> None:
        if self.compact is not None:
            count = min(prompt_len, self.compact.kept)
            sinks = torch.arange(count, device=self.cache.device).expand(self.cache.layers, self.cache.kv_heads, count)
            self.compact.fill(slot, sinks, max(count, prompt_len - (self.budget - count)), prompt_len)

    def view(self, slots: list[int], ends: list[int]) -> FixedKeptView:
        device = self.cache.device
        B = len(slots)
        ends_t = torch.tensor(ends, dtype=torch.long, device=device)  # [B]
        sink = min(self.config.sink, self.budget)
        kept = torch.arange(sink, device=device).expand(B, self.cache.kv_heads, sink)  # [B, kv_heads, sink]
        count = torch.clamp(ends_t, max=sink)  # [B]
        return FixedKeptView(lambda layer: kept, count, count, ends_t, self.budget, self.timer,
                             layer_invariant=True, slots=torch.tensor(slots, dtype=torch.long, device=device),
                             compact=self.compact)

