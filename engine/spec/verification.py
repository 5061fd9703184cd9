"""Verifying a round of drafted tokens against the target: greedy matching and rejection sampling.

Both take the target's scores for all gamma + 1 positions of a round (the pending token followed by
the gamma draft tokens) and return, per row, how many draft tokens are accepted and the token the
target contributes after them (its correction at the first rejection, or the bonus token after a
full accept). With gamma = 0 this is plain decoding. Rejection sampling makes the emitted tokens
distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023). `verify_rows` verifies
a batch whose rows have their own parameters: greedy rows by matching, each group of sampled rows by
rejection sampling with its own warping of the target's logits (the drafts' q was warped the same
way when they were drawn). Pure tensor functions: no models, caches or stopping rules here.
"""

from __future__ import annotations

import torch

from engine.core.sampling import BatchSampling, greedy_tokens, sample_rows, uniform_rows, warp


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix where the target's argmax equals the draft.

    target_logits: [B, gamma + 1, vocab]; draft_tokens: [B, gamma].
    Returns accepted [B] (0..gamma) and next_token [B].
    """
    target_tokens = greedy_tokens(target_logits)  # [B, gamma + 1]
    gamma = draft_tokens.shape[1]
    matches = (target_tokens[:, :gamma] == draft_tokens).long()  # [B, gamma]
    accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token


def verify_sampling(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling, row by row with each row's own generator.

    target_probs: [B, gamma + 1, vocab]; draft_probs: [B, gamma, vocab] (the distributions the draft
    tokens were sampled from); draft_tokens: [B, gamma]. Token i is accepted with probability
    min(1, p_i(x) / q_i(x)); at the first rejection the replacement is drawn from
    norm(max(p_i - q_i, 0)); after a full accept the bonus token is drawn from p_gamma.
    Returns accepted [B] and next_token [B].
    """
    B, gamma = draft_tokens.shape
    device = target_probs.device
    if gamma > 0:
        p_x = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, gamma]
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, gamma]
        u = uniform_rows(gamma, generators, device)  # [B, gamma]
        # u < p/q written without the division (q_x > 0: the draft sampled x from q).
        keep = (u * q_x < p_x).long()
        accepted = keep.cumprod(dim=1).sum(dim=1)  # [B]
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=device)
    final = target_probs.gather(1, accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    rejected = accepted < gamma  # [B]
    if rejected.any():
        rows = rejected.nonzero().squeeze(1)
        q_at = draft_probs[rows, accepted[rows]]  # [R, vocab]
        residual = (final[rows] - q_at).clamp_(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        # p == q at that position cannot reject (u < 1); guard the degenerate all-zero residual anyway.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final[rows])
        final = final.clone()
        final[rows] = residual
    next_token = sample_rows(final, generators)
    return accepted, next_token


def verify_rows(target_logits: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                sampling: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row under its own parameters.

    target_logits: [B, gamma + 1, vocab]; draft_probs: [B, gamma, vocab], each sampled row's q as its
    draft tokens were drawn (warped with that row's parameters; greedy rows' entries are unused), or
    None when every row is greedy; draft_tokens: [B, gamma]. Returns accepted [B] and next_token [B].
    """
    if sampling.all_greedy:
        return verify_greedy(target_logits, draft_tokens)
    B, gamma = draft_tokens.shape
    if draft_probs is None:  # gamma = 0: nothing was drafted
        draft_probs = target_logits.new_zeros(B, 0, target_logits.shape[-1], dtype=torch.float32)
    first = sampling.groups[0]
    if first.rows is None:  # one warping for the whole batch
        return verify_sampling(warp(target_logits, first.params), draft_probs, draft_tokens, first.generators)
    accepted = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    next_token = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    if sampling.greedy_rows is not None:
        rows = sampling.greedy_rows
        accepted[rows], next_token[rows] = verify_greedy(target_logits[rows], draft_tokens[rows])
    for group in sampling.groups:
        rows = group.rows
        accepted[rows], next_token[rows] = verify_sampling(warp(target_logits[rows], group.params),
                                                           draft_probs[rows], draft_tokens[rows], group.generators)
    return accepted, next_token
