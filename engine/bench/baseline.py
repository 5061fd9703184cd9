"""transformers' own decode step, timed on the engine's K/V: the baseline `magicdec bench` compares with.

A twin of the loaded model with transformers' sdpa attention and its `DynamicCache`, filled with the
very K/V the engine holds for the same rows, steps greedily as `generate` would (`model(...)` then
argmax) and is timed per step. Nothing here is used to generate output.
"""

from __future__ import annotations

import copy
import time

import torch

from engine.core.kv_cache import KVCache
from engine.models.loading import LoadedModel


def transformers_twin(loaded: LoadedModel) -> torch.nn.Module:
    """The same weights in transformers' own model class with its sdpa attention."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.model.config)
    config._attn_implementation = "sdpa"
    with torch.device(loaded.device):
        twin = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype, attn_implementation="sdpa")
    twin.load_state_dict(loaded.model.state_dict())
    return twin.eval().requires_grad_(False)


def transformers_step_ms(twin: torch.nn.Module, cache: KVCache, slots: list[int], length: int,
                         tokens: list[int], steps: int) -> float:
    """Mean milliseconds of `steps` greedy decode steps (after one warm-up) of rows whose first `length`
    positions are cached in `slots` of the engine's cache; tokens: each row's next input token."""
    from transformers import DynamicCache

    device = cache.device
    hf_cache = DynamicCache(config=twin.config)
    index = torch.tensor(slots, device=device)
    for layer in range(cache.layers):
        k = cache.k[layer].index_select(0, index)[:, :, :length].clone()  # [B, kv_heads, length, D]
        v = cache.v[layer].index_select(0, index)[:, :, :length].clone()
        hf_cache.update(k, v, layer)
    batch = len(slots)
    ids = torch.tensor(tokens, device=device)[:, None]  # [B, 1]
    mask = torch.ones(batch, length + 1, dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for step in range(steps + 1):
            sync()
            t0 = time.perf_counter()
            out = twin(input_ids=ids, attention_mask=mask, past_key_values=hf_cache, use_cache=True)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)  # what generate does per greedy step
            sync()
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
    return 1e3 * sum(times) / len(times)
