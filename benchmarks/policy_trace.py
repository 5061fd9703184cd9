"""`bench_variants.py` with the `gamma: auto` policy's every reading and choice printed, round by round.

Each round prints the gamma it ran, its draft and verification seconds and the first rows' accepted
counts (`observe g=...`), and each choice the policy's state behind it: the draft step's average,
the acceptance and the verification time per gamma (`next ...`). Use it to see why a short job spent
its rounds where it did; the arguments are bench_variants.py's. Example:

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/policy_trace.py --methods guided --gamma auto \\
        --prompts sample_data/needle.jsonl --context 3456 --new-tokens 48 --budget 512 --out /tmp/trace.json

With `run` first, the arguments are `magicdec run`'s instead, and a whole job is traced:

    PYTHONPATH=. .venv/bin/python benchmarks/policy_trace.py run recipes/docqa.yaml \
        --input sample_data/docqa_shared.jsonl --output /tmp/out.jsonl --overwrite --quiet > trace.log

Not a test; it changes nothing the policy does.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from engine.spec.gamma import GammaPolicy

_observe, _next_gamma = GammaPolicy.observe, GammaPolicy.next_gamma


def observe(self, **reading) -> None:
    print(f"observe g={reading['gamma']} rows={reading['rows']} draft={reading['draft_s']:.3f} "
          f"verify={reading['verify_s']:.3f} acc={reading['accepted'][:4]}", flush=True)
    _observe(self, **reading)


def next_gamma(self) -> int:
    gamma = _next_gamma(self)
    verify = {g: round(ema.value, 3) for g, ema in self.t_verify.items()}
    print(f"  next {gamma} tD {self.t_draft.value} alpha {self.alpha:.3f} {verify}", flush=True)
    return gamma


if __name__ == "__main__":
    GammaPolicy.observe, GammaPolicy.next_gamma = observe, next_gamma
    if sys.argv[1:2] == ["run"]:  # a whole job: `magicdec run ...`'s own arguments
        sys.argv = ["magicdec"] + sys.argv[1:]
        runpy.run_module("magicdec_cli.main", run_name="__main__")
    else:
        script = Path(__file__).with_name("bench_variants.py")
        sys.argv = [str(script)] + sys.argv[1:]
        runpy.run_path(str(script), run_name="__main__")
