"""The cost model and the measured gamma policy."""

from __future__ import annotations

import pytest

from engine.spec.gamma import GammaPolicy, best_gamma, expected_tokens, relative_time


def test_expected_tokens_is_the_geometric_sum():
    alpha = 0.8
    for g in range(0, 6):
        assert expected_tokens(g, alpha) == pytest.approx(sum(alpha ** i for i in range(g + 1)))
    assert expected_tokens(3, 1.0) == 4


def test_best_gamma_follows_the_costs():
    verify = lambda g: 1.0 + 0.02 * g  # verification almost free (memory-bound target)
    g, speedup = best_gamma(0.8, 0.1, verify, 1.0, 8)
    assert g >= 3 and speedup > 1.8
    assert relative_time(g, 0.8, 0.1, verify(g), 1.0) == pytest.approx(1 / speedup)
    g, speedup = best_gamma(0.8, 0.9, lambda g: 1.5 + 0.5 * g, 1.0, 8)  # drafting as dear as decoding
    assert g == 0 and speedup == 1.0


def drive(policy: GammaPolicy, t_target: float, t_draft: float, t_verify_slope: float, alpha: float, rounds: int):
    """Feed the policy synthetic timings; returns the gammas it chose."""
    chosen = []
    for _ in range(rounds):
        g = policy.next_gamma()
        chosen.append(g)
        accepted = [min(g, round(alpha * g + 0.49))] * 8  # rows accept about alpha of their drafts
        policy.observe(gamma=g, rows=8, draft_s=g * t_draft, verify_s=t_target + t_verify_slope * g,
                       accepted=accepted)
    return chosen


def test_auto_speculates_when_it_pays_and_still_measures_plain_steps():
    policy = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    chosen = drive(policy, t_target=1.0, t_draft=0.1, t_verify_slope=0.05, alpha=0.9, rounds=80)
    assert chosen[:3] == [0] * GammaPolicy.WARMUP_PLAIN + [GammaPolicy.PROBE_GAMMA]  # warm-up: plain rounds, then a probe
    assert max(chosen[10:]) >= 3 and chosen[10:].count(0) <= 10  # mostly speculating, deep
    assert 0 in chosen[10:]  # an occasional plain round keeps T_T current
    assert policy.predicted_speedup > 1.5


def test_auto_decodes_plainly_when_drafting_costs_too_much():
    policy = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    chosen = drive(policy, t_target=1.0, t_draft=1.2, t_verify_slope=0.5, alpha=0.95, rounds=80)
    later = chosen[10:]
    assert later.count(0) >= 0.85 * len(later)  # plain decoding...
    assert set(later) <= {0, GammaPolicy.PROBE_GAMMA} and GammaPolicy.PROBE_GAMMA in later  # ...with cheap probes


def test_probes_back_off_while_speculation_keeps_losing_and_resume_when_it_pays():
    replan = 8
    policy = GammaPolicy("auto", gamma_max=6, replan_every=replan, speculative=True)
    losing = drive(policy, t_target=1.0, t_draft=1.2, t_verify_slope=0.5, alpha=0.95, rounds=600)
    probes = [i for i, g in enumerate(losing) if g > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps), gaps  # each gap at least the one before...
    assert gaps[-1] == GammaPolicy.MAX_PROBE_BACKOFF * replan  # ...up to the cap
    # the warm-up probe, the first periodic one, 3 doublings (8 -> 64 rounds), then one per cap:
    # not one per period (75 here)
    assert len(probes) <= 2 + 4 + 600 // (GammaPolicy.MAX_PROBE_BACKOFF * replan), probes
    # Drafting becomes cheap (e.g. the batch's reads stop being shared): the next probe sees it.
    winning = drive(policy, t_target=1.0, t_draft=0.1, t_verify_slope=0.05, alpha=0.9, rounds=200)
    first = next(i for i, g in enumerate(winning) if g >= 2)
    assert first <= (GammaPolicy.MAX_PROBE_BACKOFF + 2) * replan, winning
    assert winning[first:].count(0) <= 0.2 * len(winning[first:])  # speculating from then on
    assert policy.probe_period == replan  # and the next losing spell backs off from the start again


def test_a_gamma_chosen_on_an_extrapolated_verify_time_is_replanned_once_measured():
    # T_V(0) = T_V(1): the line through them says verification is free, so the first plan takes
    # gamma_max; its first round measures T_V(8) at 4.2 T_T, and the very next round replans.
    policy = GammaPolicy("auto", gamma_max=8, replan_every=16, speculative=True)
    verify = lambda g: 1.0 if g <= 1 else 1.0 + 0.4 * g  # noqa: E731
    chosen = []
    for _ in range(6):
        g = policy.next_gamma()
        chosen.append(g)
        policy.observe(gamma=g, rows=8, draft_s=g * 0.1, verify_s=verify(g), accepted=[min(g, round(0.8 * g))] * 8)
    assert chosen[:4] == [0] * GammaPolicy.WARMUP_PLAIN + [GammaPolicy.PROBE_GAMMA] + [8]
    assert chosen[4] < 8, chosen
    measured = [best_gamma(policy.alpha, 0.1, policy.verify_time, 1.0, 8)[0]]
    assert chosen[-1] in measured + [0, GammaPolicy.PROBE_GAMMA], chosen


def test_a_fixed_cost_per_speculative_round_does_not_hide_the_gamma_that_pays():
    # T_V(0) = 1 but every speculative round costs ~0.9 more, whatever its gamma (e.g. the guided
    # view's mass and selection): the line through T_V(0) and T_V(1) says no gamma pays, while
    # gamma 4-6 is 1.6x faster. The policy tries one unmeasured gamma, then speculates deep.
    policy = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    verify = lambda g: 1.0 if g == 0 else 1.9 + 0.05 * g  # noqa: E731
    chosen = []
    for _ in range(40):
        g = policy.next_gamma()
        chosen.append(g)
        policy.observe(gamma=g, rows=8, draft_s=g * 0.1, verify_s=verify(g), accepted=[min(g, round(0.9 * g))] * 8)
    assert chosen[:3] == [0] * GammaPolicy.WARMUP_PLAIN + [GammaPolicy.PROBE_GAMMA]
    assert relative_time(1, policy.alpha, 0.1, verify(1), 1.0) > 1  # the probe alone loses
    first = next(i for i, g in enumerate(chosen) if g >= 3)
    assert first <= 4, chosen  # tried at the first plan, not after a backed-off probe
    assert sum(g >= 3 for g in chosen[first:]) >= 0.75 * len(chosen[first:]), chosen


def test_a_slow_first_decode_step_does_not_make_a_losing_draft_look_cheap():
    # The job's first step pays first touches (1.5x here). Against that T_T a gamma-1 round of a
    # draft costing 1.4 target steps would look like a win (1.4 + 1.05 < 2 x 1.5): the policy must
    # judge it against the steps after, and decode plainly.
    policy = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    chosen = []
    for round_index in range(60):
        g = policy.next_gamma()
        chosen.append(g)
        verify = 1.5 if round_index == 0 else 1.0 + 0.05 * g
        policy.observe(gamma=g, rows=8, draft_s=g * 1.4, verify_s=verify, accepted=[g] * 8)
    assert relative_time(1, 0.999, 1.4, 1.05, 1.5) < 1 < relative_time(1, 0.999, 1.4, 1.05, 1.0)
    assert policy.t_verify[0].value == pytest.approx(1.0)
    assert chosen.count(0) >= 0.9 * len(chosen), chosen


@pytest.mark.parametrize("t_draft, alpha", [(0.1, 0.9), (1.2, 0.95), (0.45, 0.7)])
def test_the_look_ahead_from_a_plain_round_is_the_next_rounds_choice(t_draft, alpha):
    """`speculates_after_plain_round`, asked before a plain round runs, says what `next_gamma` then
    chooses (warm-up, probes backing off, periodic plain rounds while speculating, replans), and asking
    changes nothing."""
    policy = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    chosen, looked = [], {}
    for index in range(400):
        g = policy.next_gamma()
        chosen.append(g)
        if g == 0:
            looked[index] = policy.speculates_after_plain_round()
        accepted = [min(g, round(alpha * g + 0.49))] * 8
        policy.observe(gamma=g, rows=8, draft_s=g * t_draft, verify_s=1.0 + 0.05 * g, accepted=accepted)
    assert all(looked[i] == (chosen[i + 1] > 0) for i in looked if i + 1 < len(chosen)), looked
    assert True in looked.values() and False in looked.values()
    fresh = GammaPolicy("auto", gamma_max=6, replan_every=8, speculative=True)
    assert drive(fresh, 1.0, t_draft, 0.05, alpha, 400) == chosen  # the look-ahead left no trace


def test_fixed_gamma_and_plain_method():
    assert drive(GammaPolicy(3, 8, 16, speculative=True), 1, 0.1, 0.1, 0.8, 5) == [3] * 5
    assert drive(GammaPolicy("auto", 8, 16, speculative=False), 1, 0.1, 0.1, 0.8, 5) == [0] * 5
