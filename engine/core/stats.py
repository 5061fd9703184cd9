"""Counters the engine keeps while it runs, and their summary under the contract's report names.

Definitions follow vLLM's so numbers compare: a *draft* is one row's proposal in one round;
`acceptance_rate = accepted_tokens / draft_tokens`; `mean_accepted_length = 1 + accepted_tokens /
drafts`; `per_position_acceptance[i]` is the share of drafts long enough to have a position i whose
token i was accepted. Timings are wall-clock seconds. This module only counts; the report module
renders.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt tokens computed (the target's)
    prefill_tokens_reused: int = 0  # prompt tokens whose K/V came from the prefix store instead
    prefill_s: float = 0.0
    decode_tokens: int = 0  # tokens emitted by decode rounds (the first token comes from prefill)
    decode_s: float = 0.0
    rounds: int = 0
    row_steps: int = 0  # sum over rounds of the rows in the round
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # drafts that stopped before their end (each has exactly one rejection)
    gamma_sum: int = 0  # sum over rounds of gamma (0 for plain rounds)
    spec_rounds: int = 0  # rounds with gamma >= 1
    draft_s: float = 0.0  # draft forwards, including the compressor's selection
    select_s: float = 0.0  # the compressor's selection alone (PQCache's per-step search), prefill included
    round_select_s: float = 0.0  # the part of select_s spent in decode rounds (PQCache's search, the guided re-selection)
    verify_s: float = 0.0
    position_proposed: list[int] = dataclasses.field(default_factory=list)
    position_accepted: list[int] = dataclasses.field(default_factory=list)
    accepted_histogram: list[int] = dataclasses.field(default_factory=list)  # drafts by accepted length 0..gamma
    gamma_trace: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (round, gamma) on change

    def record_round(self, *, gamma: int, rows: int, accepted: list[int], emitted: int) -> None:
        self.rounds += 1
        self.row_steps += rows
        self.decode_tokens += emitted
        if not self.gamma_trace or self.gamma_trace[-1][1] != gamma:
            self.gamma_trace.append((self.rounds, gamma))
        if gamma == 0:
            return
        self.spec_rounds += 1
        self.gamma_sum += gamma
        self.drafts += rows
        self.draft_tokens += rows * gamma
        self.accepted_tokens += sum(accepted)
        self.rejections += sum(1 for a in accepted if a < gamma)
        while len(self.position_proposed) < gamma:
            self.position_proposed.append(0)
            self.position_accepted.append(0)
        for i in range(gamma):
            self.position_proposed[i] += rows
            self.position_accepted[i] += sum(1 for a in accepted if a > i)
        while len(self.accepted_histogram) < gamma + 1:
            self.accepted_histogram.append(0)
        for a in accepted:
            self.accepted_histogram[a] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance probability alpha (geometric MLE: accepts / (accepts + rejections))."""
        trials = self.accepted_tokens + self.rejections
        return self.accepted_tokens / trials if trials else 0.0

    def speculative_summary(self, method: str, budget: int) -> dict[str, Any]:
        drafts = self.drafts
        return {
            "method": method,
            "budget": budget if method != "none" else 0,
            "gamma": self.gamma_sum / self.rounds if self.rounds else 0.0,  # mean over all rounds
            "drafts": drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": 1 + self.accepted_tokens / drafts if drafts else 0.0,
            "per_position_acceptance": [a / p if p else 0.0
                                        for a, p in zip(self.position_accepted, self.position_proposed)],
            "accepted_length_histogram": list(self.accepted_histogram),
            "draft_s": self.draft_s,
            "select_s": self.select_s,
            "round_select_s": self.round_select_s,
            "verify_s": self.verify_s,
            "rounds": self.rounds,
            "spec_rounds": self.spec_rounds,
            "gamma_trace": [list(x) for x in self.gamma_trace],
        }

    def throughput_summary(self) -> dict[str, Any]:
        total_s = self.prefill_s + self.decode_s
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_reused": self.prefill_tokens_reused,
            "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
            "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "total_tokens_per_s": (self.prefill_tokens + self.decode_tokens) / total_s if total_s else 0.0,
        }
