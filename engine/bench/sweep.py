"""`magicdec bench`: side-by-side throughput of transformers, the engine, and MagicDec per method.

Every configuration is a real job of the engine: B requests of L prompt tokens through the very
scheduler and rounds `magicdec run` uses (`engine.spec.decoder.build_engine`), with the recipe's
defaults except what a flag sets. One process, one run. The first configuration prefills the
prompts; their K/V then stay in a prefix store shared by every configuration (`engine.core.
prefix_store`), so later ones reuse them instead of prefilling again (for a shorter context, the
first L tokens of the same prompts). Per configuration: prefill tokens/s, decode tokens/s, T_T
(a plain round), T_D (one draft step), T_V (a verify forward), the compressor's selection per round,
acceptance, and `plan`'s prediction
at the measured acceptance, the step times taken from the rounds in which every row was still
generating ("steady", what a long job sustains, since it refills freed slots at once).
transformers' own decode step is timed on the same rows' K/V. Greedy speculative outputs are
checked against the plain outputs. Results: JSON, a Markdown table and PNG plots
(`engine.bench.render`). This is a benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engine.bench.baseline import transformers_step_ms, transformers_twin
from engine.bench.prompts import bench_prompts
from engine.bench.render import PAPER_ALPHA
from engine.config.loading import recipe_from_dict
from engine.config.schema import DEFAULT_MODEL, DRAFT_METHODS, Recipe
from engine.core.attention import ATTN_NAME  # importing it registers the engine's attention with transformers
from engine.core.host_memory import keep_freed_pages
from engine.core.prefix_store import PrefixStore
from engine.core.scheduler import RoundRecord, Scheduler
from engine.core.sequence import Request
from engine.errors import JobError
from engine.models.loading import load_model, model_shapes, resolve_device, resolve_dtype
from engine.models.shapes import kv_bytes_per_token, linear_params, normalize_shapes, shape_name, shapes_for
from engine.planning.hardware import hardware_profile, read_bandwidth
from engine.planning.roofline import plan
from engine.spec.decoder import build_engine
from engine.spec.draft.gemms import resolve_linear_dtype
from engine.spec.gamma import relative_time


@dataclasses.dataclass
class BenchSpec:
    model: str = DEFAULT_MODEL
    batches: tuple[int, ...] = (16,)
    contexts: tuple[int, ...] = (4096,)
    methods: tuple[str, ...] = DRAFT_METHODS
    budgets: tuple[int, ...] = (512,)
    gammas: tuple[Any, ...] = (2, 3)  # ints and/or "auto"
    new_tokens: int = 64
    prompts: str | None = None  # JSONL with a `prompt` column (real text); default: engine.bench.prompts
    hf: bool = True  # also time transformers' decode step
    hf_steps: int = 6
    dtype: str = "auto"
    device: str = "auto"
    layers: int | None = None  # shape models only: fewer layers (per-layer costs are what matter)
    draft_linear_dtypes: tuple[str, ...] = ("auto",)  # draft.linear_dtype settings, each timed


def parse_list(text: str, cast=int, *, flag: str = "list", allow_auto: bool = False) -> tuple:
    """"1,4,16" -> (1, 4, 16); a value that is not a `cast` (or "auto" where allowed) is a JobError."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if allow_auto and item == "auto":
            values.append(item)
            continue
        try:
            values.append(cast(item))
        except ValueError:
            raise JobError(f"--{flag}: {item!r} is not {'an integer' if cast is int else 'valid'}") from None
    if not values:
        raise JobError(f"--{flag}: give at least one value")
    return tuple(values)


class RoundTally:
    """The engine's `on_round` observer: totals over the rounds in which all `batch` rows were active."""

    def __init__(self, batch: int, first_full_round: Callable[[], None] | None = None):
        self.batch = batch
        self.first_full_round = first_full_round
        self.rounds = self.draft_steps = self.tokens = 0
        self.seconds = self.draft_s = self.verify_s = 0.0

    def __call__(self, record: RoundRecord) -> None:
        if record.rows != self.batch:
            return
        if self.rounds == 0 and self.first_full_round is not None:
            self.first_full_round()
        self.rounds += 1
        self.draft_steps += record.gamma
        self.tokens += record.emitted
        self.seconds += record.seconds
        self.draft_s += record.draft_s
        self.verify_s += record.verify_s


class Bench:
    def __init__(self, spec: BenchSpec):
        self.spec = spec
        self._check(spec)
        self.shape_model = shape_name(spec.model) is not None
        self.loaded = load_model(spec.model, attn_implementation=ATTN_NAME, dtype=spec.dtype, device=spec.device,
                                 layers=spec.layers)
        self.device = self.loaded.device
        if self.device.type == "cpu":
            keep_freed_pages()  # as `magicdec run` does (engine.job.run.load_engine)
        self.max_batch, self.max_context = max(spec.batches), max(spec.contexts)
        # [max_batch] prompts of max_context tokens; tails: a shorter context keeps their ends
        self.prompts, self.tails = bench_prompts(self.loaded.tokenizer, self.max_batch, self.max_context,
                                                 path=spec.prompts, vocab=self.loaded.config.vocab_size)
        self.stores: tuple[PrefixStore | None, PrefixStore | None] | None = None  # made by the first engine
        self.rows: list[dict[str, Any]] = []
        self.plain_tokens: dict[tuple[int, int], list[list[int]]] = {}
        self._twin = None

    def _check(self, spec: BenchSpec) -> None:
        """Every flag checked before anything loads: one line (JobError), exit 2."""
        if min(spec.batches) < 1 or min(spec.contexts) < 2:
            raise JobError("--batch must be >= 1 and --context >= 2")
        if spec.prompts and not Path(spec.prompts).is_file():
            raise JobError(f"--prompts: {spec.prompts} is not a file")
        model_shapes(spec.model)  # an unknown model or shape name is a JobError here
        if spec.layers and shape_name(spec.model) is None:
            raise JobError("--layers builds a random-weight model: use it with a <name>-shape --model")
        for method in spec.methods:  # every recipe this bench will build: methods, gammas, dtypes
            for linear_dtype in spec.draft_linear_dtypes:
                for gamma in spec.gammas:
                    self.recipe(method, spec.budgets[0], gamma, linear_dtype)
        device = resolve_device(spec.device)
        for linear_dtype in spec.draft_linear_dtypes:  # e.g. int8 where this torch cannot run it
            resolve_linear_dtype(linear_dtype, resolve_dtype(spec.dtype, device), device)

    def recipe(self, method: str, budget: int, gamma, linear_dtype: str = "auto", batch: int = 1,
               context: int = 2) -> Recipe:
        """The job recipe of one configuration: the defaults, but for what the bench's flags set."""
        spec = self.spec
        return recipe_from_dict({
            "model": spec.model, "dtype": spec.dtype, "device": spec.device,
            "draft": {"method": method, "budget": budget or 512, "linear_dtype": linear_dtype},
            "spec": {"gamma": gamma if method != "none" else 1},
            "batch": {"size": batch, "max_len": context + spec.new_tokens,
                      # every prompt stays in the prefix store, so no configuration prefills again
                      "prefix_cache": self.max_batch_tokens()},
            "sampling": {"max_new_tokens": spec.new_tokens}}, source="bench")

    def max_batch_tokens(self) -> int:
        return max(self.spec.batches) * (max(self.spec.contexts) + 64)

    # ------------------------------------------------------------------ one configuration

    def run_config(self, method: str, budget: int, gamma, batch: int, context: int,
                   linear_dtype: str = "auto") -> dict[str, Any]:
        recipe = self.recipe(method, budget, gamma, linear_dtype, batch, context)
        holder: dict[str, Scheduler] = {}
        hf: dict[str, float] = {}
        baseline = (lambda: hf.update(ms=self._transformers_ms(holder["engine"]))) \
            if method == "none" and self.spec.hf else None
        tally = RoundTally(batch, baseline)
        engine = build_engine(recipe, self.loaded, on_round=tally, stores=self.stores)
        holder["engine"] = engine
        self.stores = (engine.decoder.prefill_targets[0].store, None)
        prompts = [p[-context:] if self.tails else p[:context] for p in self.prompts[:batch]]
        requests = [Request(i, i, prompts[i], self.spec.new_tokens) for i in range(batch)]
        results = {r.request.index: r for r in engine.run(requests)}
        stats = engine.stats
        tokens = [results[i].token_ids for i in range(batch)]
        summary = stats.speculative_summary(method, budget)
        decoder = engine.decoder
        row = {
            "method": method, "budget": budget if method != "none" else 0, "gamma": gamma if method != "none" else 0,
            "batch": batch, "context": context, "new_tokens": self.spec.new_tokens,
            "draft_gemms": decoder.draft_forward.gemm_dtype if decoder.draft_forward else "-",
            "draft_path": decoder.draft_forward.path if decoder.draft_forward else "-",
            "prefill_tokens": stats.prefill_tokens, "prefill_tokens_reused": stats.prefill_tokens_reused,
            "prefill_s": stats.prefill_s,
            "prefill_tokens_per_s": stats.prefill_tokens / stats.prefill_s if stats.prefill_tokens else 0.0,
            "decode_tokens": stats.decode_tokens, "decode_s": stats.decode_s,
            "decode_tokens_per_s": stats.decode_tokens / stats.decode_s,
            "steady_tokens_per_s": tally.tokens / tally.seconds if tally.seconds else stats.decode_tokens / stats.decode_s,
            "acceptance_rate": summary["acceptance_rate"], "mean_accepted_length": summary["mean_accepted_length"],
            "alpha": stats.token_acceptance, "mean_gamma": summary["gamma"],
            "rounds": stats.rounds, "steady_rounds": tally.rounds,
            # Step times from the full-batch rounds, or (a job too short to have any) from all rounds.
            "t_draft_ms": 1e3 * (tally.draft_s / tally.draft_steps if tally.draft_steps else
                                 stats.draft_s / max(stats.gamma_sum, 1)),
            "t_verify_ms": 1e3 * (tally.verify_s / tally.rounds if tally.rounds else stats.verify_s / stats.rounds),
            "select_s": stats.select_s,
            # the compressor's selection per round (PQCache's search over its draft steps, the guided
            # re-selection after verification), prefill excluded
            "select_ms_per_round": 1e3 * stats.round_select_s / stats.rounds if stats.rounds else 0.0,
        }
        compressor = decoder.compressor
        if getattr(compressor, "selected_entries", 0) and compressor.compact is not None:
            # the guided view with a compact store: the share of re-selected kept entries copied anew
            row["view_changed_share"] = compressor.changed_entries / compressor.selected_entries
        key = (batch, context)
        if method == "none":
            self.plain_tokens[key] = tokens
            row["t_target_ms"] = row["t_verify_ms"]
            if "ms" in hf:
                row["hf_step_ms"] = hf["ms"]
        else:
            row["identical_to_plain"] = sum(a == b for a, b in zip(tokens, self.plain_tokens.get(key, [])))
        return row

    def _transformers_ms(self, engine: Scheduler) -> float:
        """transformers' decode step on the rows the engine holds now (after one plain round)."""
        if self._twin is None:
            self._twin = transformers_twin(self.loaded)
        seqs = list(engine.active)
        length = engine.target.cache.lengths[seqs[0].slot]
        return transformers_step_ms(self._twin, engine.target.cache, [s.slot for s in seqs], length,
                                    [s.pending_token for s in seqs], self.spec.hf_steps)

    # ------------------------------------------------------------------ the sweep

    def run(self, log=print) -> dict[str, Any]:
        spec = self.spec
        hardware = measure_device(self.device)
        log(f"measured read bandwidth {hardware['read_bw'] / 1e9:.1f} GB/s; {self.max_batch} prompts of "
            f"{self.max_context} tokens, prefilled once")
        shapes = normalize_shapes(shapes_for(spec.model) if self.shape_model else model_shapes(spec.model))
        if spec.layers:
            shapes["layers"] = spec.layers
        element = torch.empty((), dtype=self.loaded.dtype).element_size()
        # One plain config first, its figures dropped, so that the first measured one does not pay for
        # first-call set-up (on an H200, 131 ms against 55 ms per step at batch 16 x 32K).
        # It also prefills the prompts, cold, once: the prefill figures below are its.
        first = self.run_config("none", 0, 0, max(spec.batches), max(spec.contexts))
        for context in spec.contexts:
            for batch in spec.batches:
                plain = self.run_config("none", 0, 0, batch, context)
                step_bytes = linear_params(shapes) * element + batch * context * kv_bytes_per_token(shapes, element)
                plain["bytes_per_step"] = step_bytes
                plain["achieved_bw"] = step_bytes / (plain["t_target_ms"] / 1e3)
                plain["read_bw"] = read_bandwidth(self.device)  # measured now, beside the step it judges
                plain["bw_fraction"] = plain["achieved_bw"] / plain["read_bw"]
                if "hf_step_ms" in plain:
                    plain["engine_vs_hf"] = plain["hf_step_ms"] / plain["t_target_ms"]
                self.rows.append(plain)
                log(_line(plain))
                configs = [(m, b, g, d) for m in spec.methods if m != "none" for b in spec.budgets
                           for d in spec.draft_linear_dtypes for g in spec.gammas]
                for method, budget, gamma, linear_dtype in configs:
                    row = self.run_config(method, budget, gamma, batch, context, linear_dtype)
                    row["speedup"] = row["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
                    row["steady_speedup"] = row["steady_tokens_per_s"] / plain["steady_tokens_per_s"]
                    row["t_draft_over_t_target"] = row["t_draft_ms"] / plain["t_target_ms"]
                    row["t_verify_over_t_target"] = row["t_verify_ms"] / plain["t_target_ms"]
                    row["select_over_t_target"] = row["select_ms_per_round"] / plain["t_target_ms"]
                    row["predicted_speedup"] = self._predict(shapes, hardware, row, element)
                    self.rows.append(row)
                    log(_line(row))
        return {"spec": dataclasses.asdict(spec), "hardware": dict(hardware),
                "at_paper_acceptance": at_acceptance(self.rows, PAPER_ALPHA),
                "prefill": {"rows": first["batch"], "context": first["context"], "tokens": first["prefill_tokens"],
                            "seconds": first["prefill_s"], "tokens_per_s": first["prefill_tokens_per_s"]},
                "device": str(self.device), "threads": torch.get_num_threads(),
                "acceptance_meaningful": not self.shape_model, "rows": self.rows,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__}

    def _predict(self, shapes, hardware, row, element) -> float:
        """The roofline's speedup for this row at the acceptance it measured (alpha)."""
        gamma = row["gamma"] if isinstance(row["gamma"], int) else None
        alpha = min(max(row["alpha"], 0.0), 0.999)
        predicted = plan(shapes=shapes, hardware=hardware, batch=row["batch"], context=row["context"],
                         method=row["method"], budget=row["budget"], acceptance=alpha, dtype_bytes=element,
                         gamma=gamma)
        return predicted["predicted_speedup"]


def at_acceptance(rows: list[dict[str, Any]], alpha: float) -> list[dict[str, Any]]:
    """The speedup the *measured* T_T, T_D and T_V(g) give at acceptance alpha, per batch x context x
    method x budget: max over the measured g of Omega(g, alpha) T_T / (g T_D + T_V(g)). For random
    weights, whose own acceptance means nothing, this is the number to read."""
    out = []
    plain = {(r["batch"], r["context"]): r for r in rows if r["method"] == "none"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["method"] != "none" and isinstance(r["gamma"], int):
            groups.setdefault((r["batch"], r["context"], r["method"], r["budget"], r.get("draft_gemms", "-")),
                              []).append(r)
    for (batch, context, method, budget, gemms), runs in groups.items():
        t_target = plain[(batch, context)]["t_target_ms"]
        t_draft = sum(r["t_draft_ms"] for r in runs) / len(runs)
        by_gamma = {r["gamma"]: r["t_verify_ms"] for r in runs}
        speedups = {g: 1 / relative_time(g, alpha, t_draft, t_v, t_target) for g, t_v in by_gamma.items()}
        best = max(speedups, key=speedups.get)
        out.append({"batch": batch, "context": context, "method": method, "budget": budget, "draft_gemms": gemms,
                    "alpha": alpha,
                    "t_target_ms": t_target, "t_draft_ms": t_draft, "t_draft_over_t_target": t_draft / t_target,
                    "t_verify_over_t_target": {g: t / t_target for g, t in by_gamma.items()},
                    "best_gamma": best, "speedup": speedups[best]})
    return out


def measure_device(device: torch.device) -> dict[str, Any]:
    """A hardware profile of the device the bench runs on, with `read_bw`, its read bandwidth now."""
    if device.type == "cuda":
        profile = dict(hardware_profile(_gpu_profile_name()))
        profile["name"] = torch.cuda.get_device_name()
    else:
        profile = dict(hardware_profile("measure"))
    profile["read_bw"] = read_bandwidth(device)
    return profile


def _gpu_profile_name() -> str:
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100", "l40"):
        if key in name:
            return key
    return "h100"


def _line(row: dict[str, Any]) -> str:
    head = f"B={row['batch']:<3} L={row['context']:<6} {row['method']:<12}"
    if row["method"] == "none":
        text = f"{head} plain  {row['decode_tokens_per_s']:8.1f} tok/s  T_T {row['t_target_ms']:.1f} ms"
        if "hf_step_ms" in row:
            text += f"  transformers {row['hf_step_ms']:.1f} ms ({row['engine_vs_hf']:.2f}x)"
        return text + (f"  {row['achieved_bw'] / 1e9:.1f} GB/s ({100 * row['bw_fraction']:.0f}% of "
                       f"{row['read_bw'] / 1e9:.1f} GB/s measured)")
    return (f"{head} b={row['budget']:<5} g={row['gamma']!s:<4} {row['draft_gemms']:<8} "
            f"{row['decode_tokens_per_s']:8.1f} tok/s "
            f"x{row['speedup']:.2f} (steady x{row['steady_speedup']:.2f}, plan x{row['predicted_speedup']:.2f})  "
            f"acc {row['acceptance_rate']:.2f}  "
            f"T_D/T_T {row['t_draft_over_t_target']:.2f}  T_V/T_T {row['t_verify_over_t_target']:.2f}  "
            f"select {row['select_ms_per_round']:.1f} ms/round  "
            f"same {row.get('identical_to_plain', '-')}/{row['batch']}")
