"""The command line as users and cron jobs see it: exit codes, one-line errors, outputs, --json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from engine.core import kernels
from magicdec_cli.main import app

runner = CliRunner()
FAST = ["--set", "batch.size=3", "--set", "batch.max_len=256", "--set", "sampling.max_new_tokens=8",
        "--set", "draft.budget=32", "--set", "draft.window=8", "--quiet"]
ROWS = [{"id": f"r{i}", "prompt": text} for i, text in enumerate([
    "The capital of France is", "Write a haiku about rivers.", "def add(a, b):", "Once upon a time,",
    "List three prime numbers:"])]
CONTRACT_KEYS = {
    "job": ["recipe", "model", "input", "output", "rows", "rows_ok", "rows_failed", "wall_s"],
    "throughput": ["prefill_tokens", "prefill_s", "decode_tokens", "decode_s", "decode_tokens_per_s",
                   "total_tokens_per_s"],
    "speculative": ["method", "budget", "gamma", "drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
                    "mean_accepted_length", "per_position_acceptance", "draft_s", "verify_s"],
    "memory": ["peak_bytes"], "hardware": ["device", "threads", "tp"],
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments):
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------ refused before anything runs

def test_unknown_recipe_key_names_the_closest(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = invoke("run", "generic", "--input", data, "--set", "draft.budgte=64")
    assert result.exit_code == 2
    one_line_error(result, "draft.budgte", "draft.budget")


def test_bad_recipe_value_and_missing_recipe(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2-135m-instruct\ndraft:\n  method: snapkw\n")
    result = invoke("run", bad, "--input", data)
    assert result.exit_code == 2
    one_line_error(result, "bad.yaml", "draft.method", "snapkv")
    result = invoke("run", tmp_path / "nope.yaml", "--input", data)
    assert result.exit_code == 2
    one_line_error(result, "nope.yaml")


def test_a_bad_panel_rows_setting_is_refused_before_the_output_opens(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "kept"}\n')  # an earlier job's output: --overwrite must not reach it
    monkeypatch.setenv("MAGICDEC_PANEL_ROWS", "lots")
    result = invoke("run", "generic", "--input", data, "--output", out, "--overwrite")
    assert result.exit_code == 2
    one_line_error(result, "MAGICDEC_PANEL_ROWS", "lots")
    assert out.read_text() == '{"id": "kept"}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("name,content", [("missing.jsonl", None), ("rows.csv", "a,b\n"), ("empty.jsonl", "\n"),
                                          ("bad.jsonl.gz", "not gzip")])
def test_unreadable_or_empty_input(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    result = invoke("run", "generic", "--input", path)
    assert result.exit_code == 2
    one_line_error(result, name)


def test_truncated_parquet_is_refused(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    path.write_bytes(path.read_bytes()[:-20])
    result = invoke("validate", "generic", "--input", path)
    assert result.exit_code == 2
    one_line_error(result, "rows.parquet")


def test_existing_output_is_left_untouched(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    result = invoke("run", "generic", "--input", data, "--output", out)
    assert result.exit_code == 2
    one_line_error(result, "out.jsonl", "--resume", "--overwrite")
    assert out.read_text() == '{"id": "old"}\n'


def test_int8_draft_gemms_where_torch_cannot_run_them_is_refused(tmp_path, monkeypatch):
    """Before the model loads and before any output exists: run and bench alike."""
    from engine.spec.draft import gemms as draft_gemms

    monkeypatch.setattr(draft_gemms, "int8_supported", lambda: False)
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    result = invoke("run", "generic", "--input", data, "--output", out, "--set", "draft.linear_dtype=int8")
    assert result.exit_code == 2
    one_line_error(result, "draft.linear_dtype", "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    result = invoke("bench", "--model", "tiny-shape", "--batch", "1", "--context", "64", "--no-hf",
                    "--draft-linear-dtype", "int8", "--out", tmp_path / "bench")
    assert result.exit_code == 2
    one_line_error(result, "draft.linear_dtype", "int8")
    assert not (tmp_path / "bench").exists()


def test_debug_variable_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_DEBUG", "1")
    result = invoke("run", "generic", "--input", tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and "Traceback" in result.output


# ------------------------------------------------------------------ jobs on the real default model

@pytest.mark.real_model
def test_json_summary_has_the_contract_keys_and_bad_rows_become_error_records(tmp_path):
    rows = ROWS + [{"id": "no-prompt", "text": "wrong column"}]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "broken", "prompt": \n')
    out = tmp_path / "out.jsonl"
    result = invoke("run", "generic", "--input", data, "--output", out, *FAST[:-1], "--json")
    assert result.exit_code == 1, result.output  # finished, with error records
    summary = json.loads(result.stdout)  # stdout is exactly one JSON object
    for section, keys in CONTRACT_KEYS.items():
        assert all(k in summary[section] for k in keys), (section, summary[section].keys())
    assert summary["job"]["rows"] == 7 and summary["job"]["rows_failed"] == 2
    written = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["id"]: r for r in written}
    assert len(written) == 7 == len(by_id)
    assert by_id["no-prompt"]["finish_reason"] == "error" and "prompt" in by_id["no-prompt"]["error"]
    broken = [r for r in written if r["finish_reason"] == "error" and r["id"] != "no-prompt"][0]
    assert "JSON" in broken["error"] and broken["text"] is None
    for row in ROWS:
        ok = by_id[row["id"]]
        assert ok["error"] is None and isinstance(ok["text"], str) and ok["output_tokens"] > 0 and ok["prompt_tokens"] > 0
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["job"]["rows_ok"] == 5
    # The report names what served the job, so no slow fallback goes unseen.
    hardware = report["hardware"]
    assert hardware["dtype"] == "float32"
    if os.environ.get(kernels.REQUIRE_ENV) == "1":  # the kernel is required wherever a compiler exists
        assert all(path.startswith("fused CPU") for path in hardware["attention"].values()), hardware
        if "avx512f" not in kernels.cpu_flags().split():  # where the few-row GEMM kernel is meant to serve
            assert hardware["linear"].startswith("few-row CPU kernel"), hardware
        assert hardware["decode_forward"].startswith("lean stack"), hardware  # float32 Llama on CPU
    assert "| compute | float32 GEMMs and KV cache; attention: decode " in (tmp_path / "out.jsonl.report.md").read_text()


def assert_points_spread(report, rows, prefill_chunk=512):
    """A point per ~2 s of the job (from its model load to its end); where single pieces of work (a
    prefill chunk, a round) take longer than that (a busy machine), a point every other piece: the
    timeline is sampled between pieces, never inside a forward."""
    points = report["timeline"]
    span = points[-1]["t"] - points[0]["t"]
    pieces = report["speculative"]["rounds"] + sum(-(-r["prompt_tokens"] // prefill_chunk) for r in rows)
    assert len(points) >= min(span / 2, pieces / 2), (len(points), span, pieces)


STEP_LINE = re.compile(r"magicdec: (converting the model once: .+|converted .+ in [\d.]+ s|"
                       r"keeping .+'s blocks for decode steps in .+ \(once\)|kept .+'s blocks in [\d.]+ s|"
                       r"compiling the fused CPU kernels once into .+|compiled the fused CPU kernels in [\d.]+ s|"
                       r"waiting for another magicdec process .+)$")


@pytest.mark.real_model
def test_first_run_on_an_empty_model_cache_names_its_steps_and_keeps_stdout_pure_json(tmp_path):
    # Converting the packaged GGUF imports DeepSpeed through transformers, whose logger writes to the
    # stdout of its import time: a fresh process with a fresh cache is the only honest way to see it.
    # The kernels are left out (MAGICDEC_CPU_KERNEL=0): compiling them again into this fresh cache would
    # cost the suite ~90 s on 2 cores, and their build announces itself through the same `step` lines
    # (tests/test_progress.py checks how those render).
    data = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    env = {**os.environ, "MAGICDEC_CACHE": str(tmp_path / "cache"), "MAGICDEC_CPU_KERNEL": "0"}
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run([sys.executable, "-m", "magicdec_cli.main", "run", "generic", "--input", str(data),
                           "--output", str(tmp_path / "out.jsonl"), *FAST[:-1], "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["job"]["rows_ok"] == 1, done.stdout
    assert any((tmp_path / "cache" / "models").glob("*/model.safetensors"))  # it did convert
    # --json draws no progress: everything on stderr comes before it would, and each line names its step.
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(STEP_LINE.match(line) for line in lines), done.stderr
    steps = [line.split(":")[1].split()[0] for line in lines if "waiting for" not in line]
    assert steps == ["converting", "converted"], done.stderr


@pytest.mark.real_model
def test_the_time_line_adds_up_in_the_json_and_the_markdown_and_the_timeline_covers_the_job(tmp_path):
    rows = ROWS + [{"id": "r5", "prompt": "The three laws of motion are"}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    result = invoke("run", "generic", "--input", data, "--output", out, *FAST[:4], "--set", "sampling.max_new_tokens=24",
                    *FAST[6:])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    times = report["time"]
    parts = [times[f"{name}_s"] for name in ("startup", "load", "prefill", "decode", "other")]
    assert all(part >= 0 for part in parts), times
    assert sum(parts) == pytest.approx(times["total_s"], rel=0.01)
    assert times["prefill_s"] == report["throughput"]["prefill_s"] and times["decode_s"] == report["throughput"]["decode_s"]
    job = report["job"]
    assert job["wall_s"] == pytest.approx(times["prefill_s"] + times["decode_s"] + times["other_s"], rel=0.01)
    assert job["total_s"] == times["total_s"] and job["load_s"] == times["load_s"]
    markdown = (tmp_path / "out.jsonl.report.md").read_text()
    row = re.search(r"\| time \| ([\d.]+) s from process start = startup ([\d.]+) \+ load ([\d.]+) \+ "
                    r"prefill ([\d.]+) \+ decode ([\d.]+) \+ other ([\d.]+) s", markdown)
    assert row, markdown
    shown = [float(x) for x in row.groups()]
    assert sum(shown[1:]) == pytest.approx(shown[0], rel=0.01) and shown[0] == pytest.approx(times["total_s"], abs=0.05)
    assert "| row latency p50/p90/p99 from admission |" in markdown and "| peak resident |" in markdown
    assert "| KV cache allocated | " in markdown and "(touched: " in markdown
    memory = report["memory"]
    assert 0 < memory["kv_cache_touched_bytes"] < memory["kv_cache_bytes"]
    # The timeline: from the model load to the end, a point at least every ~2 s of it, in order.
    points = report["timeline"]
    assert points[0]["phase"] == "load" and points[0]["t"] == pytest.approx(times["startup_s"], abs=0.05)
    assert points[-1]["phase"] == "end" and points[-1]["rows"] == 6
    assert points[-1]["t"] <= times["total_s"]
    assert all(a["t"] < b["t"] for a, b in zip(points, points[1:]))
    assert_points_spread(report, [json.loads(line) for line in out.read_text().splitlines()])
    assert (tmp_path / "out.jsonl.report.png").stat().st_size > 0


@pytest.mark.real_model
def test_parquet_and_jsonl_give_the_same_outputs_and_openai_batch_works(tmp_path):
    jsonl = write_jsonl(tmp_path / "in.jsonl", ROWS)
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    openai = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": r["id"], "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": r["prompt"]}}
        for r in ROWS])
    outputs = {}
    for name, source, out in [("jsonl", jsonl, "a.jsonl"), ("parquet", parquet, "b.parquet"),
                              ("openai", openai, "c.jsonl")]:
        result = invoke("run", "generic", "--input", source, "--output", tmp_path / out, *FAST)
        assert result.exit_code == 0, result.output
        if out.endswith(".parquet"):
            rows = pq.read_table(tmp_path / out).to_pylist()
        else:
            rows = [json.loads(line) for line in (tmp_path / out).read_text().splitlines()]
        if name == "openai":  # an OpenAI batch input writes the OpenAI batch output format
            outputs[name] = {r["custom_id"]: (r["response"]["body"]["choices"][0]["text"],
                                              r["response"]["body"]["usage"]["completion_tokens"]) for r in rows}
        else:
            outputs[name] = {r["id"]: (r["text"], r["output_tokens"]) for r in rows}
    assert outputs["jsonl"] == outputs["parquet"] == outputs["openai"]


@pytest.mark.real_model
def test_resume_of_a_finished_job_adds_nothing(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    assert invoke("run", "generic", "--input", data, "--output", out, *FAST).exit_code == 0
    before = out.read_text()
    result = invoke("run", "generic", "--input", data, "--output", out, *FAST, "--resume")
    assert result.exit_code == 0 and out.read_text() == before
    changed = invoke("run", "generic", "--input", data, "--output", out, *FAST, "--resume",
                     "--set", "sampling.temperature=0.5")
    assert changed.exit_code == 2
    one_line_error(changed, "different recipe")


def test_validate_reports_bad_rows_without_a_model(tmp_path):
    rows = ROWS + [{"id": "x", "question": "no prompt column"}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    result = invoke("validate", "generic", "--input", data, "--json")
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert summary["rows"] == 6 and summary["rows_bad"] == 1
    assert "prompt" in summary["problems"][0]["error"]


def test_recipes_lists_and_resolves():
    listing = invoke("recipes")
    assert listing.exit_code == 0
    assert all(name in listing.output for name in ("docqa", "rag", "code", "generic"))
    shown = invoke("recipes", "docqa", "--set", "batch.size=4")
    assert shown.exit_code == 0 and "size: 4" in shown.output and "method: snapkv" in shown.output


@pytest.mark.parametrize("name, method, used, unused", [
    ("docqa", "snapkv", ["window", "kernel_size", "pooling"], ["sink", "subspaces", "bits", "kmeans_iters"]),
    ("code", "streamingllm", ["sink"], ["window", "kernel_size", "subspaces", "bits"]),
    ("rag", "pqcache", ["sink", "window", "subspaces", "bits", "kmeans_iters", "kmeans_sample"],
     ["kernel_size", "pooling"]),
])
def test_recipes_shows_the_keys_its_method_uses_and_all_of_them_with_all(tmp_path, name, method, used, unused):
    from engine.config.loading import load_recipe

    shown = invoke("recipes", name)
    assert shown.exit_code == 0, shown.output
    data = yaml.safe_load(shown.stdout)
    assert data["draft"]["method"] == method
    assert all(key in data["draft"] for key in ["budget", "linear_dtype", *used])
    assert not any(key in data["draft"] for key in unused), data["draft"]
    full = yaml.safe_load(invoke("recipes", name, "--all").stdout)
    assert all(key in full["draft"] for key in used + unused)
    # Templates read as written: a block scalar, no quotes, no doubled blank lines.
    if "\n" in data["prompt"]["template"]:
        assert "  template: |" in shown.stdout and "''" not in shown.stdout
    # What it shows is a recipe: saved and loaded back, it is the same job.
    saved = tmp_path / f"{name}.yaml"
    saved.write_text(shown.stdout)
    assert load_recipe(str(saved)).to_dict() == {**load_recipe(name).to_dict(), "name": name}


def test_recipes_for_plain_decoding_shows_no_draft_knobs():
    data = yaml.safe_load(invoke("recipes", "generic", "--set", "draft.method=none").stdout)
    assert data["draft"] == {"method": "none"} and "spec" not in data


@pytest.mark.parametrize("command", [[], ["run"], ["validate"], ["recipes"], ["plan"], ["bench"]])
def test_help_shows_flags_as_flags_and_set_as_key_value(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    text = result.output
    assert "<bool>" not in text and "<list[str]>" not in text
    if command in (["run"], ["validate"], ["recipes"]):
        assert "--set" in text and "--help" in text, text
    if "--set" in text:
        assert re.search(r"--set\s+KEY=VALUE", text), text
    for flag in ("--quiet", "--json", "--resume", "--overwrite", "--all", "--help"):
        for line in text.splitlines():
            if re.search(rf"{flag}\b(?![-=])", line) and "│" in line:
                after = line.split(flag, 1)[1]
                assert not re.match(r"\s+<", after), line


@pytest.mark.parametrize("args, fragment", [
    (["--gamma", "x"], "--gamma"), (["--batch", "0"], "--batch"), (["--dtype", "foo"], "dtype"),
    (["--model", "foo-shape"], "foo-shape"), (["--methods", "bogus"], "draft.method"),
    (["--draft-linear-dtype", "foo"], "draft.linear_dtype"), (["--prompts", "/nonexistent.jsonl"], "--prompts"),
    (["--model", "smollm2-135m-instruct", "--layers", "2"], "--layers"),
])
def test_bench_refuses_bad_flags_before_loading_anything(tmp_path, args, fragment):
    result = invoke("bench", "--model", "tiny-shape", "--batch", "1", "--context", "64", "--no-hf",
                    "--out", tmp_path / "bench", *args)
    assert result.exit_code == 2
    one_line_error(result, fragment)
    assert not (tmp_path / "bench").exists()
