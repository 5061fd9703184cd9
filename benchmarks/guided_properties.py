"""Issue 14's three comparisons, read from `bench_variants.py` results: does the guided draft win?

Not a benchmark itself and not a test: it reads the JSON a bench run wrote (one run per prompt set,
every draft side by side on the same prompts and plain baseline) and prints, per budget:

- every draft's figures the issue asks for: acceptance (accepted / drafted), mean accepted length,
  T_D/T_T, T_V/T_T, selection ms per round, speedup over plain, rows equal to plain;
- the three bars: guided's acceptance >= PQCache's; guided's T_D/T_T <= StreamingLLM's + 0.03;
  guided's speedup >= the best of StreamingLLM, SnapKV and PQCache.

A method run twice in one process (a repeat under another name, `streamingllm@sink=16` beside
`streamingllm`: `bench_variants.py` keeps the variant's name) is one draft measured twice; its
figures are the mean of the runs, and the spread (max - min) is printed beside them, so a bar decided
by less than the hour's noise shows as such.

    .venv/bin/python benchmarks/guided_properties.py benchmarks/results/guided_final/code_gamma6.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FIGURES = ("acceptance_rate", "mean_accepted_length", "t_draft_over_t_target", "t_verify_over_t_target",
           "select_ms_per_round", "speedup")
OTHERS = ("streamingllm", "snapkv", "pqcache")
T_D_MARGIN = 0.03  # the bar: guided's T_D/T_T <= StreamingLLM's + this


def draft_runs(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """(base method, budget) -> its runs (repeats under another name included); plain left out."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        if row["method"] != "none":
            runs.setdefault((row["method"].partition("@")[0], row["budget"]), []).append(row)
    return runs


def summarise(runs: list[dict]) -> dict:
    """Mean and spread (max - min) of each figure over a draft's runs, and its rows equal to plain."""
    out = {"runs": len(runs), "identical": [r.get("identical_to_plain") for r in runs]}
    for name in FIGURES:
        values = [r[name] for r in runs]
        out[name] = sum(values) / len(values)
        out[name + "_spread"] = max(values) - min(values)
    return out


def bars(drafts: dict[str, dict]) -> dict[str, dict]:
    """The issue's three bars for one budget, from the drafts' summaries (missing drafts: None)."""
    guided = drafts.get("guided")
    if guided is None:
        return {}
    pq, sl = drafts.get("pqcache"), drafts.get("streamingllm")
    others = {m: drafts[m]["speedup"] for m in OTHERS if m in drafts}
    best = max(others, key=others.get) if others else None
    return {
        "acceptance >= PQCache": None if pq is None else {
            "guided": guided["acceptance_rate"], "bar": pq["acceptance_rate"],
            "holds": guided["acceptance_rate"] >= pq["acceptance_rate"]},
        f"T_D/T_T <= StreamingLLM + {T_D_MARGIN}": None if sl is None else {
            "guided": guided["t_draft_over_t_target"], "bar": sl["t_draft_over_t_target"] + T_D_MARGIN,
            "holds": guided["t_draft_over_t_target"] <= sl["t_draft_over_t_target"] + T_D_MARGIN},
        "speedup >= best other": None if best is None else {
            "guided": guided["speedup"], "bar": others[best], "best": best,
            "holds": guided["speedup"] >= others[best]},
    }


def report(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
        result["rows"][0]["gamma"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        print(f"guided_properties.py: {path}: not a bench_variants.py result ({error})", file=sys.stderr)
        sys.exit(2)
    runs = draft_runs(result["rows"])
    budgets = sorted({budget for _, budget in runs})
    out = {"file": str(path), "date": result.get("date"), "budgets": {}}
    print(f"{path}  ({result.get('date')}, {result.get('device', '')}, gamma {result['rows'][-1]['gamma']})")
    for budget in budgets:
        drafts = {m: summarise(r) for (m, b), r in runs.items() if b == budget}
        checked = bars(drafts)
        out["budgets"][budget] = {"drafts": drafts, "bars": checked}
        print(f"  budget {budget}")
        print("    draft          runs  accepted  mean len  T_D/T_T       T_V/T_T  select ms  speedup        same")
        for method, s in drafts.items():
            print(f"    {method:<14} {s['runs']:>4}  {s['acceptance_rate']:.3f}     {s['mean_accepted_length']:5.2f}"
                  f"     {s['t_draft_over_t_target']:.3f} +-{s['t_draft_over_t_target_spread'] / 2:.3f}"
                  f"  {s['t_verify_over_t_target']:.2f}     {s['select_ms_per_round']:8.1f}"
                  f"   {s['speedup']:.2f}x +-{s['speedup_spread'] / 2:.2f}  {s['identical']}")
        for name, bar in checked.items():
            if bar is not None:
                best = f" ({bar['best']})" if "best" in bar else ""
                print(f"    {name:<32} guided {bar['guided']:.3f} vs {bar['bar']:.3f}{best}: "
                      f"{'holds' if bar['holds'] else 'FAILS'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_variants.py JSON files")
    parser.add_argument("--out", type=Path, help="write the summaries and bars here as JSON")
    args = parser.parse_args()
    summaries = [report(path) for path in args.results]
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
