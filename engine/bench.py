"""`magicdec bench`: side-by-side decode throughput of transformers, the engine, and MagicDec per method.

One process, one run, one prefill: the longest context is prefilled once for the largest batch
(random K/V for random-weight `*-shape` models, whose acceptance means nothing), and every
configuration reuses that cache by rolling each slot back to its context length, which the engine's
cache supports by design. For a context L the row's first L prompt tokens are its prompt: its cache
is cut to L - 1 positions and token L - 1 is the pending one, so shorter contexts need no prefill of
their own (causal attention: the KV of a prefix does not depend on what follows). Per configuration:
decode tokens/s, T_T (plain step), T_D (draft step), T_V (verify forward), acceptance, and the
`engine.plan` prediction at the measured acceptance; transformers' own decode step (its attention
and DynamicCache, filled with the same K/V) is timed on the same batch. Greedy speculative outputs
are checked against the engine's plain outputs. Results: JSON, a Markdown table and PNG plots.
This is a benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.attention import ForwardBatch
from engine.config import Recipe, recipe_from_dict
from engine.draft_forward import draft_forward_for
from engine.draft_gemms import resolve_linear_dtype
from engine.engine import COMPRESSORS, round_scratch
from engine.errors import JobError
from engine.kv.snapkv import WindowObserver
from engine.models import LoadedModel, load_model, model_shapes, resolve_device, resolve_dtype
from engine.plan import hardware_profile, kv_bytes_per_token, linear_params, normalize_shapes, plan, shapes_for
from engine.runner import ModelRunner
from engine.sequence import Request, Sequence
from engine.speculative import RoundRunner
from engine.stats import EngineStats


@dataclasses.dataclass
class BenchSpec:
    model: str = "smollm2-135m-instruct"
    batches: tuple[int, ...] = (16,)
    contexts: tuple[int, ...] = (4096,)
    methods: tuple[str, ...] = ("none", "streamingllm", "snapkv", "pqcache")
    budgets: tuple[int, ...] = (512,)
    gammas: tuple[Any, ...] = (2, 3)  # ints and/or "auto"
    new_tokens: int = 64
    prompts: str | None = None  # JSONL with a `prompt` column (real text); default: sample_data/long.jsonl
    hf: bool = True  # also time transformers' decode step
    hf_steps: int = 6
    dtype: str = "auto"
    device: str = "auto"
    layers: int | None = None  # shape models only: fewer layers (per-layer costs are what matter)
    sink: int = 16
    window: int = 32
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


class Bench:
    def __init__(self, spec: BenchSpec):
        self.spec = spec
        self._check(spec)
        self.shape_model = spec.model.endswith("-shape")
        self.loaded = self._load()
        self.device = self.loaded.device
        self.max_batch = max(spec.batches)
        self.max_context = max(spec.contexts)
        gamma_max = max([g for g in spec.gammas if isinstance(g, int)] + [8])
        capacity = self.max_context + spec.new_tokens + gamma_max + 2
        self.runner = ModelRunner(self.loaded, slots=self.max_batch, capacity=capacity)
        self.prompts = self._prompts()
        self.rows: list[dict[str, Any]] = []
        self.plain_tokens: dict[tuple[int, int], list[list[int]]] = {}

    # ------------------------------------------------------------------ set-up

    def _check(self, spec: BenchSpec) -> None:
        """Every flag checked before anything loads: one line (JobError), exit 2."""
        if min(spec.batches) < 1 or min(spec.contexts) < 2:
            raise JobError("--batch must be >= 1 and --context >= 2")
        if spec.prompts and not Path(spec.prompts).is_file():
            raise JobError(f"--prompts: {spec.prompts} is not a file")
        model_shapes(spec.model)  # an unknown model or shape name is a JobError here
        if spec.layers and not spec.model.endswith("-shape"):
            raise JobError("--layers builds a random-weight model: use it with a <name>-shape --model")
        for method in spec.methods:  # every recipe this bench will build: methods, gammas, dtypes
            for linear_dtype in spec.draft_linear_dtypes:
                for gamma in spec.gammas:
                    self.recipe(method, spec.budgets[0], gamma, linear_dtype)
        device = resolve_device(spec.device)
        for linear_dtype in spec.draft_linear_dtypes:  # e.g. int8 where this torch cannot run it
            resolve_linear_dtype(linear_dtype, resolve_dtype(spec.dtype, device), device)

    def _load(self) -> LoadedModel:
        spec = self.spec
        if self.shape_model and spec.layers:
            from engine import attention  # noqa: F401  (registers the attention)
            from engine.models import resolve_device, resolve_dtype, shape_config
            from transformers import AutoModelForCausalLM

            device = resolve_device(spec.device)
            dtype = resolve_dtype(spec.dtype, device)
            config = shape_config(spec.model[: -len("-shape")], num_hidden_layers=spec.layers)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="magicdec")
            model.eval().requires_grad_(False)
            return LoadedModel(spec.model, model, None, (config.eos_token_id,), config.max_position_embeddings,
                               device, dtype)
        return load_model(spec.model, dtype=spec.dtype, device=spec.device)

    def _prompts(self) -> list[list[int]]:
        """max_batch prompts of max_context tokens: real text when there is a tokenizer."""
        need, count = self.max_context, self.max_batch
        tokenizer = self.loaded.tokenizer
        if tokenizer is None:
            g = torch.Generator().manual_seed(0)
            vocab = self.loaded.config.vocab_size
            return [torch.randint(3, vocab, (need,), generator=g).tolist() for _ in range(count)]
        path = Path(self.spec.prompts or Path(__file__).resolve().parent.parent / "sample_data" / "long.jsonl")
        texts = [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        stream = [t for text in texts for t in tokenizer(text)["input_ids"]]
        if len(stream) < need:
            raise JobError(f"{path}: {len(stream)} tokens of text, {need} needed for --context {need}")
        # Row i starts at a different place of the concatenated text, so rows differ.
        step = max(1, (len(stream) - need) // max(1, count - 1))
        return [stream[i * step: i * step + need] for i in range(count)]

    def prefill(self) -> None:
        """Fill every slot with its prompt (max_context tokens) once."""
        cache = self.runner.cache
        t0 = time.perf_counter()
        if self.shape_model:  # timing only: random K/V stand in for a real prefill
            cache.k.normal_()
            cache.v.normal_()
        else:
            for slot, prompt in enumerate(self.prompts):
                ids = torch.tensor(prompt, device=self.device)
                for start in range(0, len(prompt), 512):
                    piece = ids[start:start + 512]
                    self.runner.forward(piece[None], ForwardBatch(cache, [slot], [start], len(piece)), last_only=True)
        self.prefill_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ one configuration

    def recipe(self, method: str, budget: int, gamma, linear_dtype: str = "auto") -> Recipe:
        return recipe_from_dict({
            "model": self.spec.model, "dtype": self.spec.dtype, "device": self.spec.device,
            "draft": {"method": method, "budget": budget or 512, "sink": self.spec.sink, "window": self.spec.window,
                      "linear_dtype": linear_dtype},
            "spec": {"gamma": gamma if method != "none" else 1, "replan_every": 8},
            "sampling": {"max_new_tokens": self.spec.new_tokens}})

    def reset(self, batch: int, context: int, compressor) -> list[Sequence]:
        """Roll slots 0..batch-1 back to `context - 1` cached positions with token context-1 pending."""
        seqs = []
        cache = self.runner.cache
        for slot in range(batch):
            prompt = self.prompts[slot][:context]
            cache.set_length(slot, context - 1)
            seq = Sequence(Request(slot, slot, prompt[:-1], self.spec.new_tokens + 1), slot,
                           max_len=cache.capacity, eos_ids=(), stop_strings=(), tokenizer=None, generator=None)
            seq.generated = [prompt[-1]]
            seq.max_new_tokens = self.spec.new_tokens + 1
            if compressor is not None:
                compressor.release(slot)
                observed = self._observe(slot, prompt, compressor.observe_window)
                compressor.prefill_done(slot, context, observed)
                cache.set_length(slot, context - 1)
            seqs.append(seq)
        return seqs

    def _observe(self, slot: int, prompt: list[int], window: int):
        """SnapKV's window queries: re-run the last `window` prompt tokens (same K/V rewritten)."""
        if not window:
            return None
        runner, n = self.runner, len(prompt)
        window = min(window, n)
        observer = WindowObserver(runner.layers, runner.heads, window, runner.head_dim, n - window,
                                  self.device, self.loaded.dtype)
        ids = torch.tensor(prompt[n - window:], device=self.device)
        runner.forward(ids[None], ForwardBatch(runner.cache, [slot], [n - window], window, observer=observer),
                       last_only=True)
        return observer.queries

    def run_config(self, method: str, budget: int, gamma, batch: int, context: int,
                   linear_dtype: str = "auto") -> dict[str, Any]:
        recipe = self.recipe(method, budget, gamma, linear_dtype)
        compressor = None
        if method != "none":
            compressor = COMPRESSORS[method](recipe.draft, self.runner.cache, self.runner.heads)
        draft_forward = None
        if compressor is not None:
            draft_forward = draft_forward_for(linear_dtype, self.runner, compressor, extra=round_scratch(recipe),
                                              self_speculation=True)
        seqs = self.reset(batch, context, compressor)
        stats = EngineStats()
        rounds = RoundRunner(self.runner, self.runner if compressor else None, compressor, recipe.sampling, stats,
                             draft_forward=draft_forward)
        from engine.gamma import GammaPolicy

        policy = GammaPolicy(recipe.spec.gamma, recipe.spec.gamma_max, recipe.spec.replan_every,
                             speculative=method != "none")
        # Rounds in which every row was still generating ("steady"): speculative rows finish at
        # different rounds, and the last rounds of a closed batch run with few rows; a job refills
        # freed slots at once, so the steady rounds are what a long job sustains. The step times
        # T_D and T_V are taken from them too, at the full batch.
        rounds_all = steady_rounds = steady_draft_steps = 0
        steady_tokens, steady_s, steady_draft_s, steady_verify_s = 0, 0.0, 0.0, 0.0
        active = list(seqs)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        while active:
            g = policy.next_gamma()
            r0 = time.perf_counter()
            before = stats.decode_tokens
            draft_s, verify_s, accepted = rounds.run(active, g)
            sync()
            seconds = time.perf_counter() - r0
            stats.decode_s += seconds
            if len(active) == batch:
                steady_rounds += 1
                steady_tokens += stats.decode_tokens - before
                steady_s += seconds
                steady_draft_s += draft_s
                steady_draft_steps += g
                steady_verify_s += verify_s
            policy.observe(gamma=g, rows=len(active), draft_s=draft_s, verify_s=verify_s, accepted=accepted)
            rounds_all += 1
            active = [s for s in active if not s.finished]
        wall = time.perf_counter() - t0
        tokens = [s.generated[1:] for s in seqs]
        spec = stats.speculative_summary(method, budget)
        row = {
            "method": method, "budget": budget if method != "none" else 0, "gamma": gamma if method != "none" else 0,
            "batch": batch, "context": context, "new_tokens": self.spec.new_tokens,
            "draft_gemms": draft_forward.gemm_dtype if draft_forward else "-",
            "draft_path": draft_forward.path if draft_forward else "-",
            "decode_tokens": stats.decode_tokens, "decode_s": wall,
            "decode_tokens_per_s": stats.decode_tokens / wall,
            # While every row generates (speculative rows finish at different rounds; in a job the
            # freed slots are refilled at once, so this is the rate a long job sustains).
            "steady_tokens_per_s": steady_tokens / steady_s if steady_s else 0.0,
            "acceptance_rate": spec["acceptance_rate"], "mean_accepted_length": spec["mean_accepted_length"],
            "alpha": stats.token_acceptance, "mean_gamma": spec["gamma"],
            "rounds": rounds_all, "steady_rounds": steady_rounds,
            "t_draft_ms": 1e3 * steady_draft_s / steady_draft_steps if steady_draft_steps else 0.0,
            "t_verify_ms": 1e3 * steady_verify_s / steady_rounds,
            "select_s": stats.select_s,
        }
        key = (batch, context)
        if method == "none":
            self.plain_tokens[key] = tokens
            row["t_target_ms"] = row["t_verify_ms"]
        else:
            row["identical_to_plain"] = sum(a == b for a, b in zip(tokens, self.plain_tokens.get(key, [])))
        if compressor is not None:
            compressor.timer.take()
        return row

    # ------------------------------------------------------------------ transformers' decode step

    def hf_step_ms(self, batch: int, context: int) -> float | None:
        """Mean time of transformers' own decode step (its sdpa attention + DynamicCache), same K/V."""
        from transformers import DynamicCache

        model = self.hf_model()
        cache = DynamicCache(config=model.config)
        engine_cache = self.runner.cache
        for layer in range(engine_cache.layers):
            k = engine_cache.k[layer, :batch, :, : context - 1].clone()  # [B, kv_heads, L, D]
            v = engine_cache.v[layer, :batch, :, : context - 1].clone()
            cache.update(k, v, layer)
        tokens = torch.tensor([p[context - 1] for p in self.prompts[:batch]], device=self.device)[:, None]
        mask = torch.ones(batch, context, dtype=torch.long, device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times = []
        with torch.inference_mode():
            for step in range(self.spec.hf_steps + 1):
                sync()
                t0 = time.perf_counter()
                out = model(input_ids=tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
                tokens = out.logits[:, -1].argmax(-1, keepdim=True)  # what generate does per greedy step
                sync()
                if step:  # the first step warms up
                    times.append(time.perf_counter() - t0)
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        return 1e3 * sum(times) / len(times)

    def hf_model(self):
        if getattr(self, "_hf", None) is None:
            import copy

            from transformers import AutoModelForCausalLM

            config = copy.deepcopy(self.loaded.model.config)
            config._attn_implementation = "sdpa"
            with torch.device(self.device):
                self._hf = AutoModelForCausalLM.from_config(config, dtype=self.loaded.dtype, attn_implementation="sdpa")
            self._hf.load_state_dict(self.loaded.model.state_dict())
            self._hf.eval().requires_grad_(False)
        return self._hf

    # ------------------------------------------------------------------ the sweep

    def run(self, log=print) -> dict[str, Any]:
        spec = self.spec
        hardware = measure_device(self.device)
        log(f"measured read bandwidth {hardware['read_bw'] / 1e9:.1f} GB/s; prefilling "
            f"{self.max_batch} x {self.max_context} tokens")
        self.prefill()
        shapes = normalize_shapes(shapes_for(spec.model) if self.shape_model else model_shapes(spec.model))
        if spec.layers:
            shapes["layers"] = spec.layers
        element = torch.empty((), dtype=self.loaded.dtype).element_size()
        for context in spec.contexts:
            for batch in spec.batches:
                plain = self.run_config("none", 0, 0, batch, context)
                step_bytes = linear_params(shapes) * element + batch * context * kv_bytes_per_token(shapes, element)
                plain["bytes_per_step"] = step_bytes
                plain["achieved_bw"] = step_bytes / (plain["t_target_ms"] / 1e3)
                plain["read_bw"] = read_bandwidth(self.device)  # measured now, beside the step it judges
                plain["bw_fraction"] = plain["achieved_bw"] / plain["read_bw"]
                if spec.hf:
                    plain["hf_step_ms"] = self.hf_step_ms(batch, context)
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
                    row["predicted_speedup"] = self._predict(shapes, hardware, row, element)
                    self.rows.append(row)
                    log(_line(row))
        return {"spec": dataclasses.asdict(spec), "hardware": {k: v for k, v in hardware.items()},
                "at_paper_acceptance": at_acceptance(self.rows, PAPER_ALPHA),
                "device": str(self.device), "threads": torch.get_num_threads(), "prefill_s": self.prefill_s,
                "acceptance_meaningful": not self.shape_model, "rows": self.rows,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__}

    def _predict(self, shapes, hardware, row, element) -> float:
        """engine.plan's speedup for this row at the acceptance it measured (alpha)."""
        gamma = row["gamma"] if isinstance(row["gamma"], int) else None
        alpha = min(max(row["alpha"], 0.0), 0.999)
        predicted = plan(shapes=shapes, hardware=hardware, batch=row["batch"], context=row["context"],
                         method=row["method"], budget=row["budget"], acceptance=alpha, dtype_bytes=element,
                         gamma=gamma)
        return predicted["predicted_speedup"]


PAPER_ALPHA = 0.8  # the paper's acceptance for a StreamingLLM-512 self-draft on PG-19


def at_acceptance(rows: list[dict[str, Any]], alpha: float) -> list[dict[str, Any]]:
    """The speedup the *measured* T_T, T_D and T_V(g) give at acceptance alpha, per batch x context x
    method x budget: max over the measured g of Omega(g, alpha) T_T / (g T_D + T_V(g)). For random
    weights, whose own acceptance means nothing, this is the number to read."""
    from engine.gamma import relative_time

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


def read_bandwidth(device: torch.device, repeats: int = 7) -> float:
    """Bytes/s of the median of `repeats` sums of a 512 MiB float32 tensor (all threads / the GPU).

    The median, not the best: on a shared VM single readings swing by 2x from one second to the next.
    """
    big = torch.ones(128 * 1024 * 1024, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    big.sum()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        big.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / sorted(times)[repeats // 2]


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
            f"same {row.get('identical_to_plain', '-')}/{row['batch']}")


# ---------------------------------------------------------------------------------------- output


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
                  "| plan's speedup | acceptance | mean accepted length | T_D/T_T | T_V/T_T | same as plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in spec:
            lines.append(f"| {r['batch']} | {r['context']} | {r['method']} | {r['budget']} | {r['draft_gemms']} | "
                         f"{r['gamma']} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['steady_speedup']:.2f}x | "
                         f"{r['predicted_speedup']:.2f}x | "
                         f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | "
                         f"{r['t_draft_over_t_target']:.2f} | {r['t_verify_over_t_target']:.2f} | "
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
