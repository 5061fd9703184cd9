"""`magicdec` commands. Each parses its options, calls one engine function, prints, and exits.

Exit codes (the contract): 0 every row produced output; 1 the job finished but some rows are error
records; 2 nothing was run (bad recipe, unreadable input, existing output, an output another run
holds, ...), with one line on stderr naming the file, row or key (a traceback only with
MAGICDEC_DEBUG=1); 3 the job stopped part-way (a failed write, a lost rank, an internal error), its
finished rows kept for --resume. The command functions hold no logic of their own beyond choosing
what to print.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core

from engine.config.schema import DEFAULT_MODEL
from engine.core import panel_rows
from engine.errors import JobError, OutputError
from engine.job.timeline import process_started
from magicdec_cli import IMPORTED_AT
from magicdec_cli.console import Out


def _flags_as_flags(params: list) -> list:
    """On/off options take no value: show none (this Typer writes `<bool>` after every flag)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


class Group(typer.core.TyperGroup):
    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch long-context generation with MagicDec speculative decoding.")
command = functools.partial(app.command, cls=Command)

RecipeArg = Annotated[str, typer.Argument(metavar="RECIPE", help="Recipe YAML path, or a shipped recipe name (docqa, rag, code, generic).")]
InputOpt = Annotated[Path, typer.Option("--input", "-i", metavar="PATH", help="Input rows: .parquet, .jsonl or .jsonl.gz.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override a recipe key, e.g. --set draft.method=snapkv (repeatable).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.")]


def guarded(fn):
    """Map JobError to one red line and exit 2; anything unexpected to one line and exit 3."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobError as exc:
            if os.environ.get("MAGICDEC_DEBUG") == "1":
                traceback.print_exc()
            Out().error(str(exc))
            raise typer.Exit(2)
        except KeyboardInterrupt:
            Out().error("interrupted; rerun with --resume to continue")
            raise typer.Exit(130)
        except typer.Exit:
            raise
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if os.environ.get("MAGICDEC_DEBUG") == "1":
                raise
            Out().error(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        " (set MAGICDEC_DEBUG=1 for the traceback)")
            raise typer.Exit(3)

    return wrapper


def _set_threads() -> None:
    import torch

    threads = os.environ.get("MAGICDEC_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


@command()
@guarded
def run(
    recipe: RecipeArg,
    input: InputOpt,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="PATH", help="Output .jsonl or .parquet (default: <input stem>.<recipe>.jsonl next to the input).")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", metavar="PATH", help="Report JSON (default: <output>.report.json).")] = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an existing output, skipping ids already written.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, metavar="N", help="Only the first N input rows.")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, metavar="N", help="Tensor-parallel processes (DeepSpeed AutoTP).")] = 1,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, metavar="M", help="Data-parallel engine groups, each --tp processes (default 1; under an external launcher: world size / tp).")] = None,
    output_format: Annotated[Optional[str], typer.Option("--output-format", metavar="FORMAT", help="Output rows: magicdec (its own rows) or openai (the OpenAI batch output format; default for an OpenAI batch input). Same as --set output.format=...")] = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Generate for every input row; write outputs and a throughput report."""
    from engine.job.options import JobOptions

    if resume and overwrite:
        raise JobError("--resume and --overwrite exclude each other")
    if output_format is not None and output_format not in ("magicdec", "openai"):
        raise JobError(f"--output-format must be magicdec or openai, got {output_format!r}")
    overrides = tuple(set_ or ()) + ((f"output.format={output_format}",) if output_format else ())
    out = Out(quiet=quiet, json_mode=json_).attach_engine_log()
    options = JobOptions(recipe=recipe, input=str(input), output=str(output) if output else None,
                         report=str(report) if report else None, overrides=overrides,
                         mode="resume" if resume else "overwrite" if overwrite else "new", limit=limit, tp=tp,
                         process_started=process_started(IMPORTED_AT))
    from engine.scale import launch as launching

    # SIGTERM (a scheduler, or the launcher stopping the other ranks) stops a job like Ctrl-C does: the
    # writer is closed on the way out, so rows it still buffers (Parquet parts) are kept for --resume.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    panel_rows.setting_from_env()  # a bad MAGICDEC_PANEL_ROWS stops the job before it opens its output
    try:
        if launching.needs_launch(tp, dp):  # start tp x dp worker processes running this same command
            command = [sys.executable, "-m", "magicdec_cli.main", *sys.argv[1:]]
            raise typer.Exit(launching.launch(command, tp=tp, dp=dp, options=options))
        # One job per output: checked before torch and the model load, so a second run exits at once.
        with launching.job_lock(options):
            from engine.scale import run as parallel

            _set_threads()
            outcome = parallel.run(options, out.progress(), tp=tp, dp=dp)
    except launching.WorkersFailed as exc:  # a worker, or another rank of this job, stopped early
        if exc.message:
            out.error(exc.message)
        raise typer.Exit(exc.exit_code)
    except OutputError as exc:  # the output could not be written (disk full, I/O error) part-way
        out.error(str(exc))
        raise typer.Exit(3)
    if outcome is None:  # a non-zero rank: rank 0 reports
        return
    summary = outcome.report
    if json_:
        print(json.dumps(summary, default=str))
    else:
        from engine.job.report_render import summary_rows

        out.table(f"magicdec: {outcome.output_path}", summary_rows(summary))
        out.info(f"report: {outcome.report_path}")
    raise typer.Exit(outcome.exit_code)


@command()
@guarded
def validate(recipe: RecipeArg, input: InputOpt, set_: SetOpt = None,
             limit: Annotated[Optional[int], typer.Option("--limit", min=1)] = None,
             quiet: QuietOpt = False, json_: JsonOpt = False) -> None:
    """Check the recipe and every input row (templates, lengths) without running a model."""
    from engine.job.validate import validate_job

    out = Out(quiet=quiet, json_mode=json_).attach_engine_log()
    result = validate_job(recipe, str(input), tuple(set_ or ()), limit=limit)
    if json_:
        print(json.dumps(result))
    else:
        out.table(f"validate: {input}", [(k, str(v)) for k, v in result.items() if k != "problems"], stdout=True)
        for problem in result["problems"]:
            out.info(f"[yellow]row {problem['row']}[/] (id {problem['id']}): {problem['error']}")
        if result["rows_bad"] > len(result["problems"]):
            out.info(f"... and {result['rows_bad'] - len(result['problems'])} more")
    raise typer.Exit(1 if result["rows_bad"] else 0)


@command()
@guarded
def recipes(name: Annotated[Optional[str], typer.Argument(metavar="NAME", help="Show this recipe (a shipped name or a YAML path), fully resolved.")] = None,
            set_: SetOpt = None,
            all_: Annotated[bool, typer.Option("--all", help="Show every key, also those the recipe's draft method does not use.")] = False) -> None:
    """List the shipped recipes, or show one with every default filled in (only the keys its method uses)."""
    from engine.config.loading import load_recipe, recipe_yaml, shipped_recipe, shipped_recipe_names

    if name is None:
        for recipe_name in shipped_recipe_names():
            first = shipped_recipe(recipe_name).read_text(encoding="utf-8").splitlines()[0]
            print(f"{recipe_name:10s} {first.lstrip('# ').strip()}")
        return
    print(recipe_yaml(load_recipe(name, tuple(set_ or ())), all_keys=all_), end="")


@command()
@guarded
def plan(
    recipe: RecipeArg,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Concurrent sequences B.")] = 16,
    context: Annotated[int, typer.Option("--context", min=1, help="Context length L (tokens).")] = 8192,
    acceptance: Annotated[float, typer.Option("--acceptance", min=0.0, max=0.999, help="Per-token acceptance assumed.")] = 0.8,
    hardware: Annotated[str, typer.Option("--hardware", help="a100 | h100 | h200 | l40 | measure (this machine).")] = "h100",
    tp: Annotated[int, typer.Option("--tp", min=1)] = 1,
    gamma: Annotated[Optional[int], typer.Option("--gamma", min=1, help="Evaluate this gamma instead of the best.")] = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Cost model: predicted T_T, T_D, T_V, best gamma and speedup for a recipe at B x L."""
    from engine.planning.recipe_plan import plan_recipe

    out = Out(json_mode=json_)
    result = plan_recipe(recipe, tuple(set_ or ()), batch=batch, context=context, acceptance=acceptance,
                         hardware=hardware, tp=tp, gamma=gamma)
    if json_:
        print(json.dumps(result, default=str))
        return
    from magicdec_cli.tables import display_rows

    out.table(f"plan: {recipe} on {result['hardware']['name']} (tp {tp}), B={batch}, L={context}",
              display_rows(result), stdout=True)


@command()
@guarded
def bench(
    model: Annotated[str, typer.Option("--model", help="Model to time: a recipe model, or <name>-shape (random weights, e.g. llama-3.1-8b-shape).")] = DEFAULT_MODEL,
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "16",
    context: Annotated[str, typer.Option("--context", help="Context lengths, comma-separated.")] = "4096",
    methods: Annotated[str, typer.Option("--methods", help="none,streamingllm,snapkv,pqcache,guided (any subset).")] = "none,streamingllm,snapkv,pqcache,guided",
    budget: Annotated[str, typer.Option("--budget", help="Draft budgets, comma-separated.")] = "512",
    gamma: Annotated[str, typer.Option("--gamma", help="Speculation lengths, comma-separated ints and/or auto.")] = "2,3",
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=2)] = 64,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSONL of real text (`prompt` column); default: long stretches of the Python standard library's sources.")] = None,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="Also time transformers' own decode step.")] = True,
    layers: Annotated[Optional[int], typer.Option("--layers", min=1, help="Shape models: build only this many layers.")] = None,
    draft_linear_dtype: Annotated[str, typer.Option("--draft-linear-dtype", help="The draft's GEMMs, comma-separated settings of draft.linear_dtype (auto, same, bfloat16, ...), each timed side by side.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype")] = "auto",
    device: Annotated[str, typer.Option("--device")] = "auto",
    out: Annotated[Path, typer.Option("--out", help="Folder for bench.json, bench.md and the plots.")] = Path("bench-results"),
) -> None:
    """Side-by-side decode throughput: transformers, the engine, and MagicDec per method (one process, one run)."""
    from engine.bench.render import write_outputs
    from engine.bench.sweep import Bench, BenchSpec, parse_list

    _set_threads()
    spec = BenchSpec(model=model, batches=parse_list(batch, flag="batch"), contexts=parse_list(context, flag="context"),
                     methods=parse_list(methods, str, flag="methods"), budgets=parse_list(budget, flag="budget"),
                     gammas=parse_list(gamma, flag="gamma", allow_auto=True), new_tokens=new_tokens,
                     prompts=str(prompts) if prompts else None, hf=hf, layers=layers, dtype=dtype, device=device,
                     draft_linear_dtypes=parse_list(draft_linear_dtype, str, flag="draft-linear-dtype"))
    out_console = Out().attach_engine_log()
    result = Bench(spec).run(log=out_console.info)
    for path in write_outputs(result, out):
        out_console.info(f"wrote {path}")


@command()
@guarded
def report(path: Annotated[Path, typer.Argument(help="A report JSON written by `magicdec run`.")]) -> None:
    """Render a saved report in the terminal."""
    from engine.job.report_render import summary_rows

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = summary_rows(data)
    except OSError as exc:
        raise JobError(f"{path}: cannot read report: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise JobError(f"{path}: not a magicdec report ({type(exc).__name__}: {exc})") from None
    Out().table(f"report: {data['job'].get('output', path)}", rows, stdout=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
