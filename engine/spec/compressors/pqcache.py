"""PQCache (Zhang et al. 2024) as a draft view: retrieve, at every draft step, the keys the query likes.

At prefill each slot's keys are product-quantised per layer and KV head: head_dim is split into
`subspaces` sub-vectors and each sub-space is clustered by k-means (`kmeans_iters` Lloyd steps on up
to `kmeans_sample` evenly spaced keys; each step's nearest centroids by a C++ op on CPU, `nearest`)
into 2^bits centroids; every key is stored as its centroid codes. Keys committed later are encoded
with the same centroids when a draft next reads the slot: under `gamma: auto` most rounds may be
plain, and their keys are then encoded in one batch, not one small batch a round (a job that decodes
plainly pays nothing). At each draft step the
query (summed over the query heads of a GQA group, since q.k is linear in q) is scored against the
centroids once (a lookup table), every older position's approximate score is a sum of table entries,
and the top `budget - sink - window` positions are attended to exactly, beside `sink` sinks and the
newest `window` positions. That search runs every step over B x S codes: the timer measures it, as the
paper stresses. Until a row is longer than `budget` the draft simply reads all of it.
"""

from __future__ import annotations

import torch

from engine.core import kernels as cpu_kernels
from engine.spec.compressors.base import Compressor, compose_view


class PQCache(Compressor):
    name = "pqcache"

    def __init__(self, config, cache, num_heads):
        super().__init__(config, cache, num_heads)
        D = cache.head_dim
        if D % config.subspaces:
            raise ValueError(f"draft.subspaces ({config.subspaces}) must divide the head size ({D})")
        self.subspaces = config.subspaces
        self.sub_dim = D // config.subspaces
        self.centroid_count = 2 ** config.bits
        self.retrieve = config.budget - config.sink - config.window
        code_dtype = torch.uint8 if config.bits <= 8 else torch.int16
        shape = (cache.layers, cache.slots, cache.kv_heads)
        # centroids: [layers, slots, kv_heads, subspaces, centroids, sub_dim]
        self.centroids = torch.zeros(*shape, self.subspaces, self.centroid_count, self.sub_dim,
                                     dtype=torch.float32, device=cache.device)
        # codes: [layers, slots, kv_heads, capacity, subspaces]
        self.codes = torch.zeros(*shape, cache.capacity, self.subspaces, dtype=code_dtype, device=cache.device)
        self.encoded = [0] * cache.slots  # positions with valid codes, per slot
        self.length = [0] * cache.slots  # committed positions, per slot (codes up to it are due)

    def prefill_done(self, slot: int, prompt_len: int, observed, mass=None) -> None:
        with self.timer:
            for layer in range(self.cache.layers):
                keys = self.split(self.cache.k[layer, slot, :, :prompt_len])  # [kv_heads, subspaces, P, sub]
                centroids = kmeans(keys, self.centroid_count, self.config.kmeans_iters, self.config.kmeans_sample)
                self.centroids[layer, slot] = centroids
                self.codes[layer, slot, :, :prompt_len] = nearest(keys, centroids).permute(0, 2, 1).to(self.codes.dtype)
        self.encoded[slot] = self.length[slot] = prompt_len

    def committed(self, slot: int, length: int) -> None:
        """Codes of positions up to `length` are due; `encode_due` computes them before a view reads them."""
        self.length[slot] = length
        self.encoded[slot] = min(self.encoded[slot], length)

    def encode_due(self, slot: int) -> None:
        """Encode the slot's committed keys that have no codes yet, every layer at once."""
        start, length = self.encoded[slot], self.length[slot]
        if length > start:
            with self.timer:
                layers, kv_heads = self.cache.layers, self.cache.kv_heads
                keys = self.cache.k[:, slot, :, start:length].float()  # [layers, kv_heads, n, D]
                keys = keys.reshape(layers, kv_heads, length - start, self.subspaces, self.sub_dim)
                codes = nearest(keys.permute(0, 1, 3, 2, 4), self.centroids[:, slot])  # [layers, kv_heads, m, n]
                self.codes[:, slot, :, start:length] = codes.permute(0, 1, 3, 2).to(self.codes.dtype)
        self.encoded[slot] = length

    def release(self, slot: int) -> None:
        self.encoded[slot] = self.length[slot] = 0

    def split(self, keys: torch.Tensor) -> torch.Tensor:
        """[kv_heads, n, D] -> [kv_heads, subspaces, n, sub_dim] (float32)."""
        kv_heads, n, _ = keys.shape
        return keys.float().view(kv_heads, n, self.subspaces, self.sub_dim).permute(0, 2, 1, 3)

    def view(self, slots: list[int], ends: list[int]) -> "PQView":
        for slot in slots:
            self.encode_due(slot)
        return PQView(self, slots, ends)


class PQView:
    def __init__(self, pq: PQCache, slots: list[int], ends: list[int]):
        self.pq = pq
        device = pq.cache.device
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.ends = torch.tensor(ends, dtype=torch.long, device=device)
        self.dense = max(ends) <= pq.budget  # every row fits the budget: no search needed
        sink = pq.config.sink
        B, kv_heads = len(slots), pq.cache.kv_heads
        # Rows with end <= budget are read whole: with `sink` kept and an empty search they get
        # [0, sink) + [sink, end) from compose_view. Others keep sink + retrieve positions.
        long_rows = self.ends > pq.budget
        self.kept_count = torch.where(long_rows, sink + pq.retrieve, torch.clamp(self.ends, max=sink))
        self.kept_end = torch.where(long_rows, self.ends - pq.config.window, self.kept_count)
        self.sinks = torch.arange(sink, device=device).expand(B, kv_heads, sink)
        self.search_end = int(max(ends)) - pq.config.window

    def select(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pq = self.pq
        with pq.timer:
            if self.dense:
                kept = self.sinks
            else:
                kept = torch.cat([self.sinks, self.search(layer, query)], dim=-1)
            return compose_view(kept, self.kept_count, self.kept_end, self.ends, pq.budget)

    def search(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """Top `retrieve` positions in [sink, end - window) by approximate score: [B, kv_heads, retrieve]."""
        pq = self.pq
        B, H, T, D = query.shape
        kv_heads = pq.cache.kv_heads
        q = query[:, :, -1].float().view(B, kv_heads, H // kv_heads, D).sum(dim=2)  # [B, kv_heads, D]
        q = q.view(B, kv_heads, pq.subspaces, pq.sub_dim)
        centroids = pq.centroids[layer].index_select(0, self.slots)  # [B, kv_heads, m, C, sub]
        table = torch.einsum("bhms,bhmcs->bhmc", q, centroids)  # [B, kv_heads, m, C]
        S = self.search_end
        codes = pq.codes[layer, :, :, :S].index_select(0, self.slots)  # [B, kv_heads, S, m]
        approx = table.gather(3, codes.permute(0, 1, 3, 2).long()).sum(dim=2)  # [B, kv_heads, S]
        position = torch.arange(S, device=q.device)
        outside = (position[None, :] < pq.config.sink) | (position[None, :] >= (self.ends - pq.config.window)[:, None])
        approx.masked_fill_(outside[:, None, :], float("-inf"))
        return approx.topk(pq.retrieve, dim=-1).indices  # rows longer than budget have >= retrieve candidates


def kmeans(points: torch.Tensor, count: int, iters: int, sample: int) -> torch.Tensor:
    """Lloyd's k-means, batched over leading dims, deterministic (evenly spaced initialisation).

    points: [..., n, d] -> centroids [..., count, d]. Fitted on at most `sample` evenly spaced points;
    with fewer points than centroids, points are repeated (duplicate centroids are harmless).
    """
    n = points.shape[-2]
    if n > sample:
        points = points[..., torch.linspace(0, n - 1, sample, device=points.device).long(), :]
        n = sample
    init = torch.linspace(0, n - 1, count, device=points.device).round().long()
    centroids = points[..., init, :].clone()  # [..., count, d]
    for _ in range(iters):
        assign = nearest(points, centroids)  # [..., n]
        sums = torch.zeros_like(centroids).scatter_add_(-2, assign[..., None].expand_as(points), points)
        counts = torch.zeros(centroids.shape[:-1], device=points.device).scatter_add_(
            -1, assign, torch.ones_like(assign, dtype=torch.float32))
        filled = counts > 0
        centroids = torch.where(filled[..., None], sums / counts.clamp_min(1)[..., None], centroids)
    return centroids


def nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Index of the nearest centroid (squared L2). points [..., n, d], centroids [..., C, d] -> [..., n].

    argmin ||x - c||^2 = argmax (x.c - ||c||^2 / 2). On CPU one C++ op (`pq_nearest`,
    engine/core/csrc/cpu_pqcache.cpp) whose scores stay in registers; elsewhere, or without a compiler,
    a batched matmul in chunks of points so the [n, C] scores stay in cache.
    """
    lead = points.shape[:-2]
    n, d = points.shape[-2:]
    flat_points = points.reshape(-1, n, d)  # [G, n, d]
    flat_centroids = centroids.reshape(-1, *centroids.shape[-2:])  # [G, C, d]
    kernel = cpu_kernels.load() if points.device.type == "cpu" and points.dtype == torch.float32 else None
    if kernel is not None:
        return kernel.pq_nearest(flat_points.contiguous(), flat_centroids.contiguous()).view(*lead, n)
    half_norms = (flat_centroids * flat_centroids).sum(-1)[:, None, :] / 2  # [G, 1, C]
    transposed = flat_centroids.transpose(1, 2)  # [G, d, C]
    out = torch.empty(flat_points.shape[:2], dtype=torch.long, device=points.device)  # [G, n]
    for start in range(0, n, chunk):
        scores = torch.bmm(flat_points[:, start:start + chunk], transposed)  # [G, chunk, C]
        out[:, start:start + chunk] = scores.sub_(half_norms).argmax(dim=-1)
    return out.view(*lead, n)
