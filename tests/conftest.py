"""Shared fixtures: tiny random-weight Llama models (with a transformers twin) and the real default model."""

from __future__ import annotations

import copy
import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# The fused CPU kernel is the production CPU path: wherever it can be built (a compiler is here, or CI
# says so), a failed build must fail the tests, not turn them into skips of the torch fallback.
from engine.core import kernels  # noqa: E402

if kernels.compiler_available() or os.environ.get("CI") == "true":
    os.environ[kernels.REQUIRE_ENV] = "1"


def make_tiny(seed: int = 0, *, init: float = 0.3, **overrides):
    """A LoadedModel with random weights, and a transformers reference sharing the same weights.

    A large init_range makes the logits peaked, so greedy argmax ties (which could flip on float
    noise between two correct implementations) practically never happen.
    """
    from transformers import AutoModelForCausalLM

    from engine.core import attention  # noqa: F401  (registers the "magicdec" attention implementation)
    from engine.models.loading import LoadedModel
    from engine.models.shapes import shape_config

    keys = dict(initializer_range=init, max_position_embeddings=1024)
    keys.update(overrides)
    config = shape_config("tiny", **keys)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="magicdec").eval().requires_grad_(False)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    reference.load_state_dict(model.state_dict())
    loaded = LoadedModel(name=f"tiny-{seed}", model=model, tokenizer=None, eos_token_ids=(config.eos_token_id,),
                         max_context=config.max_position_embeddings, device=torch.device("cpu"),
                         dtype=torch.float32)
    return loaded, reference


@pytest.fixture(scope="session")
def tiny():
    return make_tiny(0)


@pytest.fixture(scope="session")
def real_model():
    """The packaged SmolLM2-135M-Instruct (converted once into the cache by the first test that needs it)."""
    from engine.core import attention
    from engine.models.loading import load_model

    return load_model("smollm2-135m-instruct", attn_implementation=attention.ATTN_NAME, dtype="float32", device="cpu")


def random_prompts(count: int, low: int, high: int, vocab: int = 512, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(reference, prompt: list[int], max_new: int, eos: int | None = 2) -> list[int]:
    """transformers' own greedy generate, one prompt alone (batch 1)."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt):].tolist()


def assert_panel_call(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, linear) -> None:
    """got = linear(x) computed by GGUF panels: each row's bits the same as alone, not torch's GEMM's,
    and within float32 rounding of the float64 product (4 K eps times the terms' magnitudes)."""
    alone = torch.cat([linear(x[r:r + 1]) for r in range(x.shape[0])])
    assert torch.equal(got, alone) and not torch.equal(got, torch.nn.functional.linear(x, weight))
    want = x.double() @ weight.double().T
    K = x.shape[1]
    bound = 4 * K * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


def random_cache(*, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int, seed: int = 0):
    """A float32 CPU KVCache whose every K/V entry is a standard normal draw (seeded)."""
    from engine.core.kv_cache import KVCache

    g = torch.Generator().manual_seed(seed)
    cache = KVCache(layers=layers, slots=slots, kv_heads=kv_heads, head_dim=head_dim, capacity=capacity,
                    dtype=torch.float32, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def window_attention_scores(queries, keys, prompt_len: int, window: int) -> list[list[float]]:
    """Brute force (loops): per KV head, each position's softmax probability summed over the prompt's
    last `window` queries (causal) and the KV head's group of query heads: SnapKV's observation score.

    queries: [heads, window, D]; keys: [kv_heads, >= prompt_len, D]. Returns [kv_heads][prompt_len]."""
    import math

    heads, kv_heads, head_dim = queries.shape[0], keys.shape[0], keys.shape[-1]
    group = heads // kv_heads
    scores = []
    for h in range(kv_heads):
        score = [0.0] * prompt_len
        for qh in range(h * group, (h + 1) * group):
            for w in range(window):
                qpos = prompt_len - window + w
                logits = [float(queries[qh, w] @ keys[h, j]) / math.sqrt(head_dim) for j in range(qpos + 1)]
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                total = sum(exps)
                for j, e in enumerate(exps):
                    score[j] += e / total
        scores.append(score)
    return scores


def pooled(row: list[float], kernel: int, pooling: str = "avgpool") -> list[float]:
    """`row` pooled over `kernel` neighbours (centred; positions outside count as 0 for the average)."""
    pad = kernel // 2
    out = []
    for j in range(len(row)):
        around = [row[i] for i in range(j - pad, j + pad + 1) if 0 <= i < len(row)]
        out.append(max(around) if pooling == "maxpool" else sum(around) / kernel)
    return out


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny target and a slightly perturbed copy of it as a separate draft model (prefix-reuse tests)."""
    loaded, _ = make_tiny(3)
    draft, _ = make_tiny(3)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.005)
    return loaded, draft
