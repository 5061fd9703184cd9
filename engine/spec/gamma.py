"""MagicDec's cost model and the speculation-length (gamma) policy built on it.

With per-token acceptance probability a, a round drafting g tokens yields on average
Omega(g, a) = (1 - a^(g+1)) / (1 - a) tokens per row, and costs g * T_D + T_V(g). Relative to plain
decoding (T_T per token) the time per generated token is (g * T_D + T_V(g)) / (Omega * T_T); the best
g minimises it, and g = 0 (plain decoding) wins when no g brings it below 1.

`GammaPolicy` applies this to the running job: T_T, T_D, T_V(g) and a are measured as the job runs
(exponential moving averages, so they follow the contexts as they grow and the batch as it drains),
re-evaluated every `replan_every` rounds (after a warm-up of two plain rounds, the first of which pays
the job's first touches and is not counted), with an occasional probe round so that a policy that chose
plain decoding still notices when speculation starts to pay. Probes back off while they keep losing:
each probe of a plainly decoding policy doubles the rounds to the next one (up to `MAX_PROBE_BACKOFF`
replan periods), and a plan that speculates again resets the interval. Such a spaced probe's T_D and
T_V replace the older averages instead of joining them (the batch may have changed since). A job
whose speculation never pays (e.g. rows that read a shared prefix once, where the target step is
GEMM-bound) then spends a few probe rounds, not one every period. `magicdec plan` uses the same
functions with times predicted from a roofline instead of measured. Where the measured and
extrapolated costs say "plain" but an unmeasured gamma would pay even at the cost of the largest
measured one below it, that gamma is tried once before the policy settles on plain decoding (a
fixed per-round cost makes the straight-line extrapolation from gamma 0 and 1 overstate the others).
`speculates_after_plain_round` tells the decoder, before a plain round, whether the next one will
draft (a guided view is then chosen from that plain round's forward). No model code here.
"""

from __future__ import annotations

import copy
import math
from typing import Callable


def expected_tokens(gamma: int, alpha: float) -> float:
    """Omega(g, a): expected tokens a row emits in one round (accepted drafts + the target's token)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def relative_time(gamma: int, alpha: float, t_draft: float, t_verify: float, t_target: float) -> float:
    """Time per generated token with speculation, relative to plain decoding (< 1 means faster)."""
    if gamma == 0:
        return 1.0
    return (gamma * t_draft + t_verify) / (expected_tokens(gamma, alpha) * t_target)


def best_gamma(alpha: float, t_draft: float, t_verify: Callable[[int], float], t_target: float,
               gamma_max: int) -> tuple[int, float]:
    """(g, predicted speedup) minimising relative time over 0..gamma_max; g = 0 means do not speculate."""
    best, best_rel = 0, 1.0
    for g in range(1, gamma_max + 1):
        rel = relative_time(g, alpha, t_draft, t_verify(g), t_target)
        if rel < best_rel - 1e-12:
            best, best_rel = g, rel
    return best, 1.0 / best_rel


class _Ema:
    def __init__(self, weight: float = 0.2):
        self.weight, self.value = weight, None
        self.count = 0  # readings so far

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x
        self.count += 1

    def restart(self, x: float) -> None:
        """Forget the readings so far: x is the first that counts."""
        self.value = x
        self.count += 1


class GammaPolicy:
    """Fixed gamma, or "auto": the cost model fed with what this job measures."""

    PROBE_GAMMA = 1  # the cheapest round that measures T_D, T_V and the acceptance
    WARMUP_PLAIN = 2  # plain rounds before the first probe; the first one's T_T is dropped
    MAX_PROBE_BACKOFF = 8  # while decoding plainly, at most this many replan periods between probes

    def __init__(self, gamma: int | str, gamma_max: int, replan_every: int, speculative: bool):
        self.fixed = None if gamma == "auto" else int(gamma)
        if not speculative:
            self.fixed = 0
        self.gamma_max = gamma_max
        self.replan_every = replan_every
        self.t_draft = _Ema()  # seconds per draft step (one token for every row)
        self.t_verify: dict[int, _Ema] = {}  # gamma -> seconds per target forward of gamma + 1 tokens
        self.accepts = _Ema(0.05)  # accepted draft tokens per round-row
        self.trials = _Ema(0.05)  # accepts + rejections per round-row
        self.rounds = 0
        self.planned_at: int | None = None
        self.extrapolated = False  # whether the current plan's T_V(current) was extrapolated
        self.current = 0 if self.fixed is None else self.fixed
        self.predicted_speedup = 1.0
        self.probe_period = replan_every  # rounds from one probe of a plain policy to the next
        self.last_probe: int | None = None  # the round of the last such probe
        self.fresh_probe = False  # whether the round being run is a probe after a backed-off gap

    @property
    def alpha(self) -> float:
        if not self.trials.value:
            return 0.0
        return min(self.accepts.value / self.trials.value, 0.999)

    def observe(self, *, gamma: int, rows: int, draft_s: float, verify_s: float, accepted: list[int]) -> None:
        self.rounds += 1
        if self.fresh_probe and gamma > 0:  # a reading after a long gap: the old averages are stale
            self.t_draft.value = None
            self.t_verify.pop(gamma, None)
        self.fresh_probe = False
        verify = self.t_verify.setdefault(gamma, _Ema())
        if gamma == 0 and verify.count == 1:
            # The job's first decode step pays first touches (pages of the cache and scratch, lazily
            # built kernels): 1.4-1.5x a later step here, which would make any draft look cheap.
            verify.restart(verify_s)
        else:
            verify.add(verify_s)
        if gamma > 0:
            self.t_draft.add(draft_s / gamma)
            accepts = sum(accepted)
            rejections = sum(1 for a in accepted if a < gamma)
            self.accepts.add(accepts / rows)
            self.trials.add((accepts + rejections) / rows)

    def next_gamma(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if 0 not in self.t_verify or self.t_verify[0].count < self.WARMUP_PLAIN:
            return 0  # warm-up: plain rounds, then one probe round
        if self.t_draft.value is None:
            return self.PROBE_GAMMA
        since = self.rounds - self.planned_at if self.planned_at is not None else None
        # A plan that rested on an extrapolated T_V(g) is redone as soon as that g has been measured
        # once: a line through T_V(0) and T_V(1) alone can put g far off, and a short job would
        # otherwise spend most of its rounds there before the next periodic replan.
        measured_now = self.extrapolated and self.current in self.t_verify
        if since is None or since >= self.replan_every or measured_now:
            self.current, self.predicted_speedup = self.plan()
            self.planned_at, since = self.rounds, 0
            self.extrapolated = self.current not in self.t_verify
            if self.current > 0:
                self.probe_period = self.replan_every
        if self.replan_every >= 2 and since == self.replan_every // 2:
            # Once per period, the other choice: a plain round refreshes T_T while speculating, a
            # gamma-1 round refreshes T_D, T_V and the acceptance while decoding plainly (cheap
            # even when drafting costs more than it saves; T_V of larger gammas is extrapolated).
            if self.current > 0:
                return 0
            if self.last_probe is None or self.rounds - self.last_probe >= self.probe_period:
                self.fresh_probe = self.probe_period > self.replan_every
                if self.last_probe is not None:
                    self.probe_period = min(2 * self.probe_period, self.MAX_PROBE_BACKOFF * self.replan_every)
                self.last_probe = self.rounds
                return self.PROBE_GAMMA
        return self.current

    def speculates_after_plain_round(self) -> bool:
        """Whether the round after a plain one about to run would draft, by the policy's state now (the
        plain round's own reading counted, not its value): `next_gamma` run one round ahead on a copy.
        A guided view is chosen from a full-cache forward's attention; the plain round before a
        probe or a return to speculation is such a forward, and its view is the one the drafts read."""
        if self.fixed is not None:
            return self.fixed > 0
        ahead = copy.copy(self)  # next_gamma only rebinds scalar attributes (on the copy)
        ahead.rounds += 1
        plain = copy.copy(self.t_verify.get(0)) or _Ema()
        plain.count += 1
        ahead.t_verify = {**self.t_verify, 0: plain}
        return ahead.next_gamma() > 0

    def verify_time(self, gamma: int) -> float:
        """Measured T_V(g), or a least-squares line through the measured points for unmeasured g."""
        if gamma in self.t_verify:
            return self.t_verify[gamma].value
        points = [(g, e.value) for g, e in self.t_verify.items()]
        if len(points) == 1:
            return points[0][1]
        n = len(points)
        mean_g = sum(g for g, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((g - mean_g) ** 2 for g, _ in points)
        slope = sum((g - mean_g) * (t - mean_t) for g, t in points) / var if var else 0.0
        return max(mean_t + slope * (gamma - mean_g), 0.0)

    def optimistic_verify_time(self, gamma: int) -> float:
        """Measured T_V(g), or for an unmeasured g that of the largest measured gamma below it: the
        least an unmeasured g can cost (verification never gets cheaper with more tokens)."""
        if gamma in self.t_verify:
            return self.t_verify[gamma].value
        return self.t_verify[max(g for g in self.t_verify if g < gamma)].value

    def plan(self) -> tuple[int, float]:
        t_target = self.t_verify[0].value
        if not t_target or self.t_draft.value is None or math.isnan(t_target):
            return self.current, 1.0
        planned = best_gamma(self.alpha, self.t_draft.value, self.verify_time, t_target, self.gamma_max)
        if planned[0] == 0:
            # The line through T_V(0) and T_V(1) can put every larger gamma out of reach when the
            # step from plain to speculative carries a fixed cost (the guided view's attention mass
            # and selection, a second token per row taking the GEMMs off their memory-bound rows).
            # If some unmeasured g would pay even at the cost of the largest measured gamma below
            # it, that g is tried once; its measurement replans at once (see next_gamma).
            explore, _ = best_gamma(self.alpha, self.t_draft.value, self.optimistic_verify_time, t_target,
                                    self.gamma_max)
            if explore > 0 and explore not in self.t_verify:
                return explore, 1.0
        return planned
