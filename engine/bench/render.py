"""Rendering a bench result: JSON, a Markdown table per kind of row, and PNG plots. Reads the dict only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PAPER_ALPHA = 0.8  # the paper's acceptance for a StreamingLLM-512 self-draft on PG-19


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(result, indent=2, default=str) + "\n")
    paths[1].write_text(markdown(result))
    paths += plots(result, out)
    return paths


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"Measured {result['date']} on {result['hardware'].get('name')} ({result['device']}, "
             f"{result['threads']} threads), torch {result['torch']}, model `{result['spec']['model']}`, "
             f"{result['spec']['new_tokens']} new tokens per row, greedy."]
    if not result["acceptance_meaningful"]:
        lines.append("\nRandom weights: acceptance rates below are not meaningful, only the timings are.")
    plain = [r for r in rows if r["method"] == "none"]
    prefill = result.get("prefill") or {}
    if prefill.get("tokens"):  # what a job pays first: every prompt, computed cold by the warm-up config
        first = rows[0]
        shape = (f"{prefill['rows']} x {prefill['context']}" if "rows" in prefill  # older results lack them
                 else f"{first['batch']} x {first['context']}")
        lines += ["", "| phase | rows x context | tokens | seconds | tokens/s |", "|---|---|---|---|---|",
                  f"| prefill (cold, computed once) | {shape} | {prefill['tokens']} | "
                  f"{prefill['seconds']:.1f} | {prefill['tokens_per_s']:.1f} |",
                  f"| decode (plain, {first['new_tokens']} new tokens per row) | {first['batch']} x {first['context']} | "
                  f"{first['decode_tokens']} | {first['decode_s']:.1f} | {first['decode_tokens_per_s']:.1f} |"]
    lines += ["", "| batch | context | engine T_T (ms) | tok/s | transformers step (ms) | engine vs transformers "
              "| GB/s moved | read bandwidth measured beside it (GB/s) | % of it |", "|---|---|---|---|---|---|---|---|---|"]
    for r in plain:
        hf = f"{r['hf_step_ms']:.1f}" if "hf_step_ms" in r else "-"
        ratio = f"{r['engine_vs_hf']:.2f}x" if "engine_vs_hf" in r else "-"
        lines.append(f"| {r['batch']} | {r['context']} | {r['t_target_ms']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{hf} | {ratio} | {r['achieved_bw'] / 1e9:.1f} | {r['read_bw'] / 1e9:.1f} | "
                     f"{100 * r['bw_fraction']:.0f}% |")
    spec = [r for r in rows if r["method"] != "none"]
    if spec:
        lines += ["", "| batch | context | method | budget | draft GEMMs | gamma | tok/s | speedup | steady speedup "
                  "| plan's speedup | acceptance | mean accepted length | T_D/T_T | T_V/T_T | selection per round (ms) "
                  "| same as plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in spec:
            lines.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['budget']} | {r['draft_gemms']} | "
                         f"{r['gamma']} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['steady_speedup']:.2f}x | "
                         f"{r['predicted_speedup']:.2f}x | "
                         f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | "
                         f"{r['t_draft_over_t_target']:.2f} | {r['t_verify_over_t_target']:.2f} | "
                         f"{r.get('select_ms_per_round', 0.0):.1f} | "
                         f"{r.get('identical_to_plain', '-')}/{r['batch']} |")
    paper = result.get("at_paper_acceptance") or []
    if paper:
        lines += ["", f"Speedup the measured times give at the paper's acceptance ({PAPER_ALPHA}):", "",
                  "| batch | context | method | budget | draft GEMMs | T_D/T_T | T_V(g)/T_T | best gamma | speedup |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in paper:
            tv = ", ".join(f"{g}: {v:.2f}" for g, v in sorted(p["t_verify_over_t_target"].items()))
            lines.append(f"| {p['batch']} | {p['context']} | {p['method']} | {p['budget']} | "
                         f"{p.get('draft_gemms', '-')} | {p['t_draft_over_t_target']:.2f} | {tv} | {p['best_gamma']} | {p['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    written = []
    methods = sorted({r["method"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in methods:
        best = {}
        for r in rows:
            if r["method"] == method:
                key = r["batch"]
                best[key] = max(best.get(key, 0.0), r["decode_tokens_per_s"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], marker="o", label=method)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s (best gamma, budget)")
    ax.legend()
    fig.tight_layout()
    written.append(out / "throughput_vs_batch.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    spec = [r for r in rows if r["method"] != "none"]
    if spec:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for method in sorted({r["method"] for r in spec}):
            pts = sorted((r["budget"], r["acceptance_rate"]) for r in spec if r["method"] == method)
            left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        left.set_xlabel("draft budget")
        left.set_ylabel("acceptance rate")
        left.legend()
        right.scatter([r["predicted_speedup"] for r in spec], [r["speedup"] for r in spec])
        top = max([r["predicted_speedup"] for r in spec] + [r["speedup"] for r in spec] + [1.0]) * 1.1
        right.plot([0, top], [0, top], color="grey", linestyle="--")
        right.set_xlabel("plan's predicted speedup")
        right.set_ylabel("measured speedup")
        fig.tight_layout()
        written.append(out / "acceptance_and_plan.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
