"""SnapKV (Li et al. 2024) as a draft view: keep the prompt positions the last prompt queries attend to.

At prefill the last `window` prompt tokens observe: per layer, the softmax attention of their queries
(causal, scaled as the model scales it) over every prompt position is summed over the window and over
the query heads of each GQA group, smoothed with a 1-D pool of `kernel_size`, and the top
`budget - window` positions before the window are kept per KV head. Static afterwards: the draft reads
those positions plus the newest `window` (the observation window at first, sliding as tokens come).
The prefill usually hands that mass over from its own attention of the window tokens (see
`engine.core.prefill_attention`); `prompt_window_scores` computes it otherwise, in one more pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core.attention import cpu_kernel_for
from engine.core.kv_cache import KVCache
from engine.spec.compressors.base import Compressor, FixedKeptView


class SnapKV(Compressor):
    name = "snapkv"
    compact_store = True
    compact_ring_per_slot = True  # the kept count is fixed once the prefill chose it

    def __init__(self, config, cache, num_heads):
        super().__init__(config, cache, num_heads)
        self.observe_window = config.window
        self.keep = self.kept_entries(config)
        # [layers, slots, kv_heads, keep]: the kept positions of each slot's prompt, ascending.
        self.kept = torch.zeros(cache.layers, cache.slots, cache.kv_heads, max(self.keep, 1),
                                dtype=torch.long, device=cache.device)
        self.kept_count = torch.zeros(cache.slots, dtype=torch.long, device=cache.device)
        self.kept_end = torch.zeros(cache.slots, dtype=torch.long, device=cache.device)

    def prefill_done(self, slot: int, prompt_len: int, observed: torch.Tensor | None,
                     mass: torch.Tensor | None = None) -> None:
        """mass: [layers, kv_heads, prompt_len] from the prefill's own attention, or None (computed here)."""
        assert observed is not None, "SnapKV needs the observation window's queries"
        window = observed.shape[2]
        region = prompt_len - window  # candidates: positions before the observation window
        count = min(self.keep, max(region, 0))
        self.kept_end[slot] = max(region, 0)
        self.kept_count[slot] = count
        if count:
            with self.timer:
                if mass is None:
                    mass = prompt_window_scores(observed, self.cache, slot, prompt_len)
                scores = mass[..., :region]
                layers, kv_heads = scores.shape[:2]  # scores: [layers, kv_heads, region]
                pooled = pool_scores(scores.reshape(layers * kv_heads, region), self.config.kernel_size,
                                     self.config.pooling).view(layers, kv_heads, region)
                top = pooled.topk(count, dim=-1).indices.sort(dim=-1).values  # [layers, kv_heads, count]
                self.kept[:, slot, :, :count] = top
        if self.compact is not None:
            recent_start = max(region, 0, prompt_len - (self.budget - count))
            self.compact.fill(slot, self.kept[:, slot, :, :count], recent_start, prompt_len)

    @staticmethod
    def kept_entries(config) -> int:
        return max(config.budget - config.window, 0)

    def view(self, slots: list[int], ends: list[int]) -> FixedKeptView:
        device = self.cache.device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        ends_t = torch.tensor(ends, dtype=torch.long, device=device)
        return FixedKeptView(lambda layer: self.kept[layer].index_select(0, index),
                             self.kept_count.index_select(0, index), self.kept_end.index_select(0, index),
                             ends_t, self.budget, self.timer, layer_invariant=False, slots=index,
                             compact=self.compact)


def prompt_window_scores(observed: torch.Tensor, cache: KVCache, slot: int, prompt_len: int) -> torch.Tensor:
    """`window_scores` of every layer of a slot's prompt: observed [layers, heads, window, D] ->
    [layers, kv_heads, prompt_len].

    On a CPU with the fused kernel, one call for all layers: the window's queries are the new tokens
    of a row that ends at the prompt's end (token t sees positions <= prompt_len - window + t, the
    causal rule), and the kernel's attention mass is this softmax summed over the window and the
    group's heads, in one pass over the keys (each layer's slot a row of the cache viewed as
    [layers * slots, ...]). Elsewhere, `window_scores` layer by layer.
    """
    layers, heads, window, D = observed.shape
    kv_heads = cache.kv_heads
    kernel = cpu_kernel_for(observed, cache)
    if kernel is None:
        return torch.stack([window_scores(observed[layer], cache.k[layer, slot, :, :prompt_len], prompt_len)
                            for layer in range(layers)])
    # [layers, kv_heads, group * window, D]: heads of a group, token fastest (the kernel's row order)
    q = (observed.float() * D ** -0.5).reshape(layers, kv_heads, (heads // kv_heads) * window, D).contiguous()
    planes = cache.layers * cache.slots
    k = cache.k.view(planes, kv_heads, cache.capacity, D)  # [layers * slots, kv_heads, capacity, D]
    v = cache.v.view(planes, kv_heads, cache.capacity, D)
    rows = torch.arange(layers, dtype=torch.long) * cache.slots + slot  # layer l's plane of this slot
    ends = torch.full((layers,), prompt_len, dtype=torch.long)
    _, mass = kernel.attend_cached_scores(q, k, v, rows, ends, window, prompt_len)
    return mass  # [layers, kv_heads, prompt_len]


def window_scores(queries: torch.Tensor, keys: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Attention mass each position receives from the observation window, per KV head.

    queries: [heads, window, D] (the last `window` prompt positions, post-RoPE); keys: [kv_heads, P, D].
    Returns [kv_heads, P]: softmax(q k / sqrt(D)) summed over the window and the group's query heads.
    """
    heads, window, D = queries.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # Scaled before the product (one small [heads, window, D] multiply, not one over every logit);
    # heads of a group are contiguous.
    q = queries.float().reshape(kv_heads, group, window, D) * D ** -0.5
    logits = torch.einsum("hgwd,hpd->hgwp", q, keys.float())  # [kv_heads, group, window, P]
    # Only the window's own positions can be in a window query's future: mask those in place.
    future = torch.ones(window, window, dtype=torch.bool, device=keys.device).triu_(1)  # [query, position]
    logits[..., prompt_len - window:].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=(1, 2))  # [kv_heads, P]


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """1-D pooling along positions, same length out. scores: [kv_heads, N] -> [kv_heads, N]."""
    if kernel_size == 1:
        return scores
    pad = kernel_size // 2
    if pooling == "maxpool":
        return F.max_pool1d(scores[:, None], kernel_size, stride=1, padding=pad)[:, 0]
    return F.avg_pool1d(scores[:, None], kernel_size, stride=1, padding=pad, count_include_pad=True)[:, 0]
