"""The verifier: exact greedy cases, and rejection sampling reproduces the target distribution."""

from __future__ import annotations

import torch

from engine.core.sampling import greedy_tokens, sample_rows, uniform_rows
from engine.spec.verification import verify_greedy, verify_sampling

V = 6


def one_hot_logits(tokens: list[list[int]]) -> torch.Tensor:
    """[B, len, V] logits whose argmax is the given token at each position."""
    t = torch.tensor(tokens)
    return torch.nn.functional.one_hot(t, V).float() * 5


def test_greedy_perfect_match_takes_the_bonus_token():
    logits = one_hot_logits([[1, 2, 3, 4]])  # target argmax at each of gamma + 1 positions
    accepted, nxt = verify_greedy(logits, torch.tensor([[1, 2, 3]]))
    assert accepted.tolist() == [3] and nxt.tolist() == [4]


def test_greedy_early_mismatch_emits_the_targets_token():
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 5, 3], [0, 2, 3], [1, 2, 0]])
    accepted, nxt = verify_greedy(logits, drafts)
    assert accepted.tolist() == [1, 0, 2]
    assert nxt.tolist() == [2, 1, 3]


def test_greedy_with_no_drafts_is_plain_decoding():
    accepted, nxt = verify_greedy(one_hot_logits([[4], [0]]), torch.zeros(2, 0, dtype=torch.long))
    assert accepted.tolist() == [0, 0] and nxt.tolist() == [4, 0]


def test_greedy_tokens_are_torchs_argmax_ties_included():
    """Random logits of a decode step [B, V] and of a verification [B, T, V], and rows whose maximum
    appears several times (the first index wins, as `argmax` has it)."""
    g = torch.Generator().manual_seed(3)
    for shape in ((16, 4099), (5, 4, 4099)):
        logits = torch.randn(*shape, generator=g)
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
        tied = torch.randint(0, 3, shape, generator=g).float()  # maxima repeated at many places
        assert torch.equal(greedy_tokens(tied), tied.argmax(dim=-1))
        assert (greedy_tokens(tied) == (tied == tied.amax(dim=-1, keepdim=True)).int().argmax(dim=-1)).all()


def test_sampling_accepts_everything_when_draft_equals_target():
    g = [torch.Generator().manual_seed(i) for i in range(50)]
    p = torch.softmax(torch.randn(50, 3, V), -1)
    drafts = torch.stack([sample_rows(p[:, i], g) for i in range(2)], 1)
    accepted, _ = verify_sampling(p, p[:, :2], drafts, g)
    assert accepted.tolist() == [2] * 50


def test_sampling_rejects_a_token_the_target_never_emits():
    p = torch.zeros(1, 2, V)
    p[0, :, 3] = 1.0  # the target always says 3
    q = torch.full((1, 1, V), 1.0 / V)
    accepted, nxt = verify_sampling(p, q, torch.tensor([[5]]), [torch.Generator().manual_seed(0)])
    assert accepted.tolist() == [0] and nxt.tolist() == [3]


# --------------------------------------------------------------------------- statistical test


def emitted_tokens(sampler, p, q, n, seed=0):
    """Run one round n times; return the first emitted token and (when reached) the second."""
    B = 2000
    firsts, seconds = [], []
    for start in range(0, n, B):
        rows = min(B, n - start)
        gens = [torch.Generator().manual_seed(seed * 10_000_000 + start + i) for i in range(rows)]
        pb = p.expand(rows, -1, -1)
        qb = q.expand(rows, -1, -1)
        drafts = torch.stack([sample_rows(qb[:, i], gens) for i in range(q.shape[1])], 1)  # [rows, gamma]
        accepted, nxt = sampler(pb, qb, drafts, gens)
        tokens = torch.cat([drafts, torch.zeros(rows, 1, dtype=torch.long)], 1)
        tokens.scatter_(1, accepted[:, None], nxt[:, None])  # emitted = drafts[:accepted] + [next]
        firsts.append(tokens[:, 0])
        reached = accepted >= 1
        seconds.append(tokens[reached, 1])
    return torch.cat(firsts), torch.cat(seconds)


def tv_distance(samples: torch.Tensor, target: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=V).float() / len(samples)
    return 0.5 * float((freq - target).abs().sum())


def wrong_sampler(p, q, drafts, gens):
    """A plausible bug: after a rejection, sample from p itself instead of the residual max(p - q, 0)."""
    gamma = drafts.shape[1]
    p_x = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform_rows(gamma, gens, p.device)
    accepted = (u * q_x < p_x).long().cumprod(1).sum(1)
    final = p.gather(1, accepted[:, None, None].expand(-1, 1, V)).squeeze(1)
    return accepted, sample_rows(final, gens)


def test_rejection_sampling_converges_to_the_target_distribution():
    g = torch.Generator().manual_seed(42)
    p = torch.softmax(torch.randn(1, 3, V, generator=g) * 1.5, -1)  # target at gamma + 1 = 3 positions
    q = torch.softmax(torch.randn(1, 2, V, generator=g) * 1.5, -1)  # a rather different draft
    distances = []
    for n in (500, 40_000):
        first, second = emitted_tokens(verify_sampling, p, q, n)
        distances.append((tv_distance(first, p[0, 0]), tv_distance(second, p[0, 1])))
    # Shrinks with more samples, and ends within sampling noise (~ sqrt(V / n)) of the target.
    assert distances[1][0] < distances[0][0] and distances[1][0] < 0.015
    assert distances[1][1] < 0.02
    # The same test catches a wrong sampler: its first-token distribution stays away from p.
    first, _ = emitted_tokens(wrong_sampler, p, q, 40_000)
    assert tv_distance(first, p[0, 0]) > 0.05
