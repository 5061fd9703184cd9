"""How far can a view chosen once per round go? The guided draft with its scores from the future.

Not a test and not an engine path: a measurement of an upper bound, for issue 14's property
"acceptance >= PQCache's". The guided draft ranks positions by the attention of the *last* round's
verification queries. This bench knows each row's true next tokens (plain decoding's greedy output,
run first on the same prompts; the speculative rows are lossless, so they emit exactly those) and
gives the guided selection the attention those tokens' own queries will pay, before drafting:

- `+round`: one view per round from the attention mass of the round's gamma + 1 true queries (the
  pending token and the gamma tokens the drafts should be), summed: the issue's rule (sink, window,
  top by score, floor, successors) with perfect knowledge of the round's queries: what the rule
  reaches when its prediction of the round's attention is exact.
- `+step`: a view per draft step from that step's true query alone (the per-query masses are the
  differences of target forwards over the first m true tokens, m = 1 .. gamma): what PQCache
  approximates with its codes, exactly.
- `+last1`, `+last3`, `+last7` (not an oracle): a view per round from the queries of each row's
  newest 1, 3 or 7 committed tokens only, recomputed by a target forward, where the verification's
  own mass also sums the queries of rejected drafts: does a nearer or cleaner past predict better?

The oracle forwards write the true tokens' K/V past the committed length and are rolled back; each
draft step then overwrites its own position before reading it, as always, so the draft reads nothing
it would not read otherwise. Acceptance is the figure here; the oracle's forwards make the times
meaningless. Methods are `bench_variants.py`'s, with one of those after a guided one:

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/guided_oracle.py --gamma 6 \\
        --methods "pqcache guided guided+round guided@successors=0+round guided+step" \\
        --prompts sample_data/long.jsonl --context 3328 --budget 512,1024 --new-tokens 128 --out ...
"""

from __future__ import annotations

import torch

import engine.bench.sweep as sweep
from bench_variants import VariantBench, run_variants, variant_parser
from engine.core.attention import ForwardBatch
from engine.spec.rounds import RoundRunner

ORACLES = ("round", "step", "last1", "last3", "last7")


def split_oracle(method: str) -> tuple[str, str | None]:
    """'guided@successors=0+round' -> ('guided@successors=0', 'round')."""
    base, plus, oracle = method.rpartition("+")
    if plus and oracle in ORACLES:
        return base, oracle
    return method, None


class OracleRounds(RoundRunner):
    """RoundRunner whose guided view is chosen, before each round (or draft step), from the
    attention of the tokens the round will emit (or, `lastK`, of the newest committed ones).
    truth[i]: row i's plain greedy output."""

    def __init__(self, rounds: RoundRunner, oracle: str, truth: list[list[int]]):
        super().__init__(rounds.target, rounds.draft, rounds.compressor, rounds.stats, rounds.sync,
                         rounds.draft_forward)
        assert self.self_speculation and self.compressor.wants_mass, "the oracle is for a self-speculating guided draft"
        self.oracle, self.truth = oracle, truth
        self.step_masses: list[torch.Tensor] | None = None  # per draft step: [layers, B, kv_heads, N]
        self.round_lengths: list[int] = []  # the round's committed lengths (with step_masses)
        original_view = self.compressor.view

        def view(slots, ends):  # re-select from the step's own query before a draft step reads the view
            if self.step_masses is not None:
                step = ends[0] - self.round_lengths[0] - 1
                mass = self.step_masses[step]
                B = len(slots)
                self.compressor.observe_mass(mass, list(range(B)), list(slots), list(ends),
                                             list(self.round_lengths), 1)
            return original_view(slots, ends)

        self.compressor.view = view

    def run(self, seqs, gamma, *, refresh_view=False):
        self.step_masses = None
        if gamma and self.oracle.startswith("last"):
            self._look_back(seqs, int(self.oracle[4:]))
        elif gamma:
            self._look_ahead(seqs, gamma)
        try:
            return super().run(seqs, gamma, refresh_view=refresh_view)
        finally:
            self.step_masses = None

    def _true_tokens(self, seqs, gamma: int) -> torch.Tensor:
        """[B, gamma + 1]: each row's pending token and the gamma tokens plain decoding emitted after it."""
        rows = []
        for seq in seqs:
            done = len(seq.generated)  # the pending token is generated[-1] = truth[done - 1]
            future = self.truth[seq.request.index][done: done + gamma]
            rows.append([seq.pending_token, *future, *[seq.pending_token] * (gamma - len(future))])
        return torch.tensor(rows, dtype=torch.long, device=self.target.device)

    def _mass_of(self, tokens: torch.Tensor, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """The attention mass [layers, B, kv_heads, N] of a target forward over `tokens` [B, T] at the
        committed lengths; the forward's K/V are rolled back."""
        cache = self.target.cache
        T = tokens.shape[1]
        mass = self.compressor.new_mass(len(slots), max(lengths) + T)
        self.target.forward(tokens, ForwardBatch(cache, slots, lengths, T, mass=mass))
        for slot, n in zip(slots, lengths):
            cache.set_length(slot, n)
        return mass

    def _look_back(self, seqs, k: int) -> None:
        """Not an oracle: the view from the queries of each row's newest k committed tokens only (the
        verification's own rule sums the round's gamma + 1 queries, rejected drafts' included). Their
        K/V are recomputed by the forward and put back as they were."""
        cache = self.target.cache
        slots = [s.slot for s in seqs]
        lengths = [cache.lengths[slot] for slot in slots]
        starts = [n - k for n in lengths]
        tokens = torch.tensor([(list(s.request.prompt_ids) + s.generated[:-1])[-k:] for s in seqs],
                              dtype=torch.long, device=self.target.device)  # [B, k]
        saved = [(cache.k[:, slot, :, a:n].clone(), cache.v[:, slot, :, a:n].clone())
                 for slot, a, n in zip(slots, starts, lengths)]
        with torch.no_grad():
            mass = self.compressor.new_mass(len(slots), max(lengths))
            self.target.forward(tokens, ForwardBatch(cache, slots, starts, k, mass=mass))
        for slot, a, n, (k_saved, v_saved) in zip(slots, starts, lengths, saved):
            cache.k[:, slot, :, a:n] = k_saved
            cache.v[:, slot, :, a:n] = v_saved
            cache.set_length(slot, n)
        self.compressor.observe_mass(mass, list(range(len(seqs))), slots, [n + 1 for n in lengths], lengths, k)

    def _look_ahead(self, seqs, gamma: int) -> None:
        cache = self.target.cache
        slots = [s.slot for s in seqs]
        lengths = [cache.lengths[slot] for slot in slots]
        true = self._true_tokens(seqs, gamma)  # [B, gamma + 1]
        with torch.no_grad():
            if self.oracle == "round":
                mass = self._mass_of(true, slots, lengths)
                self.compressor.observe_mass(mass, list(range(len(seqs))), slots, [n + 1 for n in lengths],
                                             lengths, gamma + 1)
                return
            # per step: the mass of the first m true tokens' queries, m = 1 .. gamma; step j's query is
            # the (j + 1)-th, its mass the difference of consecutive sums (causal: the first m queries
            # attend alike in every one of those forwards)
            sums = [self._mass_of(true[:, :m], slots, lengths) for m in range(1, gamma + 1)]
            steps = [sums[0]]
            for m in range(1, gamma):
                width = sums[m - 1].shape[-1]
                step = sums[m].clone()
                step[..., :width] -= sums[m - 1]
                steps.append(step.clamp_(min=0.0))
        self.step_masses = steps
        self.round_lengths = lengths


class OracleBench(VariantBench):
    """bench_variants' VariantBench whose methods may end in +round or +step (a guided one)."""

    def recipe(self, method, budget, gamma, linear_dtype="auto", batch=1, context=2):
        return super().recipe(split_oracle(method)[0], budget, gamma, linear_dtype, batch, context)

    def _predict(self, shapes, hardware, row, element):
        return super()._predict(shapes, hardware, dict(row, method=split_oracle(row["method"])[0]), element)

    def run_config(self, method, budget, gamma, batch, context, linear_dtype="auto"):
        oracle = split_oracle(method)[1]
        if oracle is None:
            return super().run_config(method, budget, gamma, batch, context, linear_dtype)
        truth = self.plain_tokens[(batch, context)]
        build = sweep.build_engine

        def build_with_oracle(*args, **kwargs):
            engine = build(*args, **kwargs)
            engine.decoder.rounds = OracleRounds(engine.decoder.rounds, oracle, truth)
            return engine

        sweep.build_engine = build_with_oracle
        try:
            return super().run_config(method, budget, gamma, batch, context, linear_dtype)
        finally:
            sweep.build_engine = build


def main() -> None:
    parser = variant_parser(__doc__, gamma="6", new_tokens=128, methods_example="pqcache guided guided+round",
                            gamma_help="comma-separated ints (a fixed gamma: the oracle's rounds are slow, "
                                       "so `auto` would measure them, not the draft)")
    args = parser.parse_args()
    if "auto" in args.gamma:
        parser.error("--gamma: fixed values only (see --help)")
    for method in args.methods.split():
        base, oracle = split_oracle(method)
        if oracle and not base.startswith("guided"):
            parser.error(f"--methods: {method}: +{oracle} is for guided methods")
    run_variants(OracleBench, args, tuple(int(g) for g in args.gamma.split(",")))


if __name__ == "__main__":
    main()
