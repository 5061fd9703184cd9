"""Would the guided view accept more if its score-ranked room were shared across KV heads or layers?

Not a test and not an engine path: an experiment for issue 14 (BENCHMARKS.md section 45). The
guided rule gives every (layer, row, KV head) the same `budget - sink - window` positions by score.
Ada-KV-style allocation gives that room to a layer's KV heads together (`--share heads`: the layer's
top `kv_heads x top` scores over all its heads, so a head whose attention is spread gets more and a
peaked one fewer), or to all layers and heads of a row at once (`--share layers`). Every head still
keeps its sinks and its recent window, and the positions read in all stay as many as the rule's.
`--share none` is the rule itself, computed the same way, as the control.

It runs `bench_variants.py` with the `guided` method replaced by this variant, which reads its view
from the float32 cache through positions lists (the compact store keeps one count per slot, not per
head), so only its acceptance is meaningful, not its times. The rule's floor (faint positions by
recency) and successors apply as in `engine/spec/compressors/guided.py`, before the allocation.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/guided_allocation.py --share heads \\
        --gamma 6 --methods guided --prompts sample_data/long.jsonl --context 3328 --budget 512,1024 \\
        --new-tokens 128 --out benchmarks/results/guided_final/allocation_heads.json
"""

from __future__ import annotations

import sys

import torch

import bench_variants
from engine.spec.compressors import guided, registry

SHARES = ("none", "heads", "layers")


class SharedRoomView:
    """A draft view over positions lists: per layer, every position with each KV head's own valid flag."""

    compact = None  # read from the float32 cache

    def __init__(self, draft: "SharedRoomGuided", slots: list[int], ends: list[int]):
        device = draft.cache.device
        self.draft = draft
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # [B]
        ends_t = torch.tensor(ends, dtype=torch.long, device=device)  # [B]
        self.width = int(ends_t.max())
        position = torch.arange(self.width, device=device)  # [width]
        kept_end = draft.kept_end.index_select(0, self.slots)  # [B]
        oldest_recent = torch.maximum(kept_end, ends_t - draft.window)  # [B]
        # [B, width]: the recent window and the round's drafts, shown to every head
        self.recent = (position[None, :] >= oldest_recent[:, None]) & (position[None, :] < ends_t[:, None])
        self.positions = position.expand(len(slots), draft.cache.kv_heads, self.width).contiguous()  # [B, kv_heads, width]

    def select(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.draft.timer:
            kept = self.draft.kept_mask[layer].index_select(0, self.slots)[..., : self.width]  # [B, kv_heads, width]
            valid = (kept | self.recent[:, None, :]).contiguous()
        return self.positions, valid


class SharedRoomGuided(guided.Guided):
    """The guided rule with its score-ranked room shared by a layer's heads, or by every layer's."""

    compact_store = False
    share = "none"

    def __init__(self, config, cache, num_heads):
        super().__init__(config, cache, num_heads)
        # [layers, slots, kv_heads, capacity]: the positions each head keeps (sinks and chosen)
        self.kept_mask = torch.zeros(cache.layers, cache.slots, cache.kv_heads, cache.capacity, dtype=torch.bool,
                                     device=cache.device)

    def _update(self, slots, scores, ends, committed, *, start, scale=1.0):
        """scores [layers, B, kv_heads, N] -> each slot's kept mask (the rule's sinks and candidates;
        see `Guided._update`, whose smoothing this experiment leaves out)."""
        layers, B, kv_heads, N = scores.shape
        device = scores.device
        ends_t = torch.tensor(ends, dtype=torch.long, device=device)  # [B]
        kept_end = (ends_t - self.window).clamp(min=0)  # [B]
        if not start and self.config.successors > 0:
            scores = guided.carry_to_successors(scores, self.config.successors)
        if self.config.floor > 0:
            scores = guided.rank_faint_by_recency(scores, kept_end, self.config.floor / scale)
        position = torch.arange(N, device=device)
        outside = (position[None, :] < self.sink) | (position[None, :] >= kept_end[:, None])  # [B, N]
        ranked = scores.masked_fill(outside[None, :, None, :], float("-inf"))
        if self.share == "none":  # [layers, B, kv_heads, N] -> top per head
            flat, room = ranked, self.top
        elif self.share == "heads":  # -> [layers, B, kv_heads * N]: a layer's heads together
            flat, room = ranked.reshape(layers, B, kv_heads * N), self.top * kv_heads
        else:  # -> [B, layers * kv_heads * N]: every layer and head of a row together
            flat, room = ranked.transpose(0, 1).reshape(B, layers * kv_heads * N), self.top * kv_heads * layers
        index = flat.topk(min(room, flat.shape[-1]), dim=-1).indices
        chosen = torch.zeros(flat.shape, dtype=torch.bool, device=device).scatter_(-1, index, True)
        if self.share == "layers":
            chosen = chosen.view(B, layers, kv_heads, N).transpose(0, 1)
        chosen = chosen.reshape(layers, B, kv_heads, N) & ~outside[None, :, None, :]  # no -inf picks
        every = (kept_end - self.sink) <= self.top  # [B]: rows that keep all their candidates
        chosen |= (every[:, None] & ~outside)[None, :, None, :]
        chosen[..., : self.sink] = True
        for b, slot in enumerate(slots.tolist()):
            self.kept_mask[:, slot] = False
            self.kept_mask[:, slot, :, :N] = chosen[:, b]
        self.kept_end[slots] = kept_end

    def view(self, slots, ends):
        return SharedRoomView(self, slots, ends)


def main() -> None:
    args = sys.argv[1:]
    if "--share" not in args or args.index("--share") + 1 >= len(args) or args[args.index("--share") + 1] not in SHARES:
        print(f"guided_allocation.py: --share {' | '.join(SHARES)} is required (then bench_variants.py's flags)",
              file=sys.stderr)
        sys.exit(2)
    at = args.index("--share")
    SharedRoomGuided.share = args[at + 1]
    sys.argv = [sys.argv[0], *args[:at], *args[at + 2:]]
    registry.COMPRESSORS["guided"] = SharedRoomGuided
    bench_variants.main()


if __name__ == "__main__":
    main()
