"""engine.scale (and engine.job.shards): tensor parallel (DeepSpeed AutoTP), data-parallel shards, the launcher, failures.

The fast tests check the pieces without a model or processes: the rank grid, shard files, folding and
merging outputs, merged reports, the supervisor, and the one-line refusals. The slow ones run the real
default model in 2 CPU processes through the CLI: `--tp 2` gives the very text `--tp 1` gives (plain,
StreamingLLM, SnapKV, guided), `--dp 2` the same rows as `--dp 1`, and a rank killed mid-job ends the job
non-zero with its finished rows kept, which `--resume` completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.job import shards
from engine.scale import launch as launching
from engine.scale import shm_allreduce
from engine.scale import topology
from engine.config.loading import load_recipe
from engine.errors import JobError
from engine.job.io.input import open_input
from engine.job.io.output import OutputWriter
from engine.job.options import JobOptions, open_output, output_manifest
from engine.job.report import JobReport
from engine.core.stats import EngineStats
from magicdec_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based inks and a wooden press adapted from the ones used to make wine. Within "
             "a few decades printers worked in hundreds of European towns, books became far cheaper, literacy "
             "spread, and scholars could compare identical copies of the same text for the first time. ")
PROMPTS = ["Say hello in French.", "What is 2 + 2?", "Name a colour of the sky.", "Write a haiku about rain.",
           PARAGRAPH * 2 + "Summarise this in one sentence.", PARAGRAPH * 2 + "What did Gutenberg combine?"]
ROWS = [{"id": f"r{i}", "prompt": prompt} for i, prompt in enumerate(PROMPTS)]
# Short runs; a budget of 64 keeps the drafts' KV compressed on the ~150-token prompts.
JOB = ["--set", "batch.size=2", "--set", "batch.max_len=512", "--set", "sampling.max_new_tokens=12",
       "--set", "draft.budget=64"]
RUN_TIMEOUT_S = 300  # a hang fails the test instead of hanging CI


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kept_rows(path: Path) -> list[dict]:
    """The rows of an output a killed job left: in the file, or staged in its parts (input order)."""
    rows = read_jsonl(path) if path.exists() else []
    for part in sorted(Path(str(path) + ".parts").glob("part-*.jsonl")):
        rows += [json.loads(line)[1] for line in part.read_text().splitlines() if line.endswith("]")]
    return rows


def texts_by_id(path: Path) -> dict:
    rows = read_jsonl(path)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), f"{path} has an id twice: {ids}"
    return {row["id"]: row["text"] for row in rows}


def options(tmp_path: Path, mode: str = "new", name: str = "out.jsonl") -> JobOptions:
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    return JobOptions(recipe="generic", input=str(data), output=str(tmp_path / name), mode=mode)


def out_row(row_id, reason="stop"):
    return {"id": row_id, "text": f"t{row_id}", "finish_reason": reason, "prompt_tokens": 3,
            "output_tokens": 1, "error": None}


# ------------------------------------------------------------------ the rank grid


def test_ranks_form_groups_of_consecutive_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "4")
    topo = topology.topology(tp=2, dp=3)
    assert (topo.group, topo.leader, topo.is_leader, topo.world) == (2, 4, True, 6)
    assert topo.ranks_of(1) == [2, 3]
    monkeypatch.setenv("RANK", "5")
    assert not topology.topology(tp=2, dp=None).is_leader, "dp defaults to world size / tp under a launcher"
    assert topology.topology(tp=2, dp=None).dp == 3


def test_world_size_must_be_tp_times_dp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(JobError, match="--tp 2 does not divide the 3 processes"):
        topology.topology(tp=2, dp=None)
    with pytest.raises(JobError, match=r"--tp 1 x --dp 2 = 2 processes, but the launcher started 3"):
        topology.topology(tp=1, dp=2)


def test_launch_is_needed_only_without_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launching.needs_launch(2, None) and launching.needs_launch(1, 2)
    assert not launching.needs_launch(1, None) and not launching.needs_launch(1, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not launching.needs_launch(2, None)


def test_worker_environment_is_what_deepspeed_needs(monkeypatch):
    monkeypatch.delenv("MAGICDEC_THREADS", raising=False)
    env = launching.worker_env(rank=1, world=2, port=29555, threads=1)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "MAGICDEC_THREADS")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555", "MAGICDEC_THREADS": "1"}


# ------------------------------------------------------------------ refused before anything starts

runner = CliRunner()


def one_line_error(result, *fragments):
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_tp_beyond_the_kv_heads_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = runner.invoke(app, ["run", "generic", "-i", str(data), "--tp", "4", "--quiet"])
    assert result.exit_code == 2
    one_line_error(result, "--tp 4", "3 KV heads", "--tp 3 or less")
    assert not list(tmp_path.glob("in.generic*")), "nothing was written"


def test_tp_checks_a_separate_draft_too():
    recipe = load_recipe("generic", ("model=llama-3.2-1b-shape", "draft.model=tiny-shape"))
    topology.check_tensor_parallel(recipe, tp=2, dp=1, local=2)  # 8 and 2 KV heads: fine
    with pytest.raises(JobError, match="draft.model tiny-shape has 2 KV heads"):
        topology.check_tensor_parallel(recipe, tp=4, dp=1, local=4)


def test_world_size_mismatch_under_a_launcher_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = runner.invoke(app, ["run", "generic", "-i", str(data), "--tp", "2", "--quiet"])
    assert result.exit_code == 2
    one_line_error(result, "--tp 2 does not divide the 3 processes")


def test_existing_output_or_shard_is_refused_before_launching(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = options(tmp_path)
    (tmp_path / "out.dp1.jsonl").write_text("")
    result = runner.invoke(app, ["run", "generic", "-i", opts.input, "-o", opts.output, "--dp", "2", "--quiet"])
    assert result.exit_code == 2
    one_line_error(result, "out.dp1.jsonl exists", "--resume")


# ------------------------------------------------------------------ shards: fold, merge


def test_shard_names_keep_the_format_and_any_dp_is_found(tmp_path):
    out = tmp_path / "run.docqa.parquet"
    assert shards.shard_path(out, 3).name == "run.docqa.dp3.parquet"
    for name in ("run.docqa.dp10.parquet", "run.docqa.dp2.parquet", "run.docqa.dp2.jsonl", "other.dp0.parquet",
                 "run.docqa.dp4.parquet.manifest.json", "run.docqa.dp2.parquet.report.json"):
        (tmp_path / name).write_text("")
    assert [p.name for p in shards.existing_shards(out)] == [
        "run.docqa.dp2.parquet", "run.docqa.dp4.parquet", "run.docqa.dp10.parquet"], "a manifest alone counts"


def write_output(path: Path, opts: JobOptions, recipe, rows: list[tuple[int, dict]], half_line: bool = False,
                 finalize: bool = True) -> None:
    """Rows (input row number, row) written as `run` writes them (the recipe's order)."""
    with open_output(opts, recipe, path, open_input(opts.input), mode="new", finalize=finalize) as writer:
        for index, row in rows:
            writer.write(row, index)
    if half_line:
        target = path if path.exists() else sorted(Path(str(path) + ".parts").iterdir())[-1]
        with open(target, "a") as f:
            f.write('{"id": "half-writ')


@pytest.mark.parametrize("order", ["input", "finish"])
def test_resume_folds_every_shard_into_the_output_each_id_once(tmp_path, order):
    opts = options(tmp_path, mode="resume")
    out = Path(opts.output)
    recipe = load_recipe("generic", [f"output.order={order}"])
    opts.overrides = (f"output.order={order}",)
    write_output(out, opts, recipe, [(0, out_row("r0"))], finalize=False)  # a killed --dp run left all these
    write_output(shards.shard_path(out, 0), opts, recipe, [(2, out_row("r2")), (0, out_row("r0"))], half_line=True,
                 finalize=False)
    write_output(shards.shard_path(out, 1), opts, recipe, [(1, out_row("r1", "error"))], finalize=False)
    write_output(shards.shard_path(out, 2), opts, recipe, [(5, out_row("r5"))], finalize=False)  # from a dp 3 run

    settled = shards.settle_outputs(opts, recipe, out, dp=2)

    assert (settled.rows, settled.failed) == (4, 1)
    assert len(settled.done_ids) == 4
    assert shards.existing_shards(out) == [] and not list(tmp_path.glob("*.dp*"))
    shards.merge_shards(opts, recipe, out, [])  # what rank 0 does once the groups are done
    ids = [row["id"] for row in read_jsonl(out)]
    assert sorted(ids) == ["r0", "r1", "r2", "r5"]
    if order == "input":
        assert ids == ["r0", "r1", "r2", "r5"], "folded rows keep their input row numbers"


def test_killed_parquet_shards_are_folded_too(tmp_path):
    opts = options(tmp_path, mode="resume", name="out.parquet")
    out = Path(opts.output)
    recipe = load_recipe("generic")
    manifest = output_manifest(recipe, opts.input, "magicdec")
    committed = OutputWriter(shards.shard_path(out, 0), mode="new", manifest=manifest, part_rows=1, order="input")
    for index, row_id in ((2, "r2"), (0, "r0")):
        committed.write(out_row(row_id), index)  # each row committed as a part; the writer is never closed
    OutputWriter(shards.shard_path(out, 1), mode="new", manifest=manifest)  # killed before any part
    assert len(shards.existing_shards(out)) == 2

    settled = shards.settle_outputs(opts, recipe, out, dp=2)
    shards.merge_shards(opts, recipe, out, [])

    assert settled.rows == 2 and not list(tmp_path.glob("*.dp*"))
    import pyarrow.parquet as pq

    assert pq.read_table(out).column("id").to_pylist() == ["r0", "r2"]


def test_overwrite_removes_shards_and_new_refuses_them(tmp_path):
    opts = options(tmp_path)
    out = Path(opts.output)
    recipe = load_recipe("generic")
    write_output(shards.shard_path(out, 1), opts, recipe, [(1, out_row("r1"))])
    with pytest.raises(JobError, match="out.dp1.jsonl exists"):
        shards.settle_outputs(opts, recipe, out, dp=2)
    settled = shards.settle_outputs(options(tmp_path, mode="overwrite"), recipe, out, dp=2)
    assert settled.rows == 0 and not list(tmp_path.glob("*.dp*"))
    assert Path(str(out) + ".manifest.json").exists(), "with dp > 1 the output is created up front"


@pytest.mark.parametrize("order", ["input", "finish"])
def test_merge_appends_shards_and_reports_ids_two_groups_wrote(tmp_path, order):
    opts = options(tmp_path, mode="resume")
    opts.overrides = (f"output.order={order}",)
    recipe = load_recipe("generic", opts.overrides)
    out = Path(opts.output)
    write_output(out, opts, recipe, [(None, out_row("old"))])
    write_output(shards.shard_path(out, 0), opts, recipe, [(4, out_row("c")), (0, out_row("a")), (2, out_row("dup"))],
                 finalize=False)
    write_output(shards.shard_path(out, 1), opts, recipe, [(1, out_row("b")), (3, out_row("dup"))], finalize=False)
    dropped = shards.merge_shards(opts, recipe, out, shards.existing_shards(out))
    ids = [row["id"] for row in read_jsonl(out)]
    assert sorted(ids) == ["a", "b", "c", "dup", "old"]
    if order == "input":
        assert ids == ["old", "a", "b", "dup", "c"], "rows already merged first, then input order"
    assert [row["id"] for row in dropped] == ["dup"]
    assert not list(tmp_path.glob("*.dp*"))


# ------------------------------------------------------------------ one report


def group_part(rows_ok, decode_tokens, decode_s, accepted, drafted, latencies):
    stats = EngineStats(decode_tokens=decode_tokens, decode_s=decode_s, prefill_tokens=100, prefill_s=1.0,
                        drafts=drafted // 2, draft_tokens=drafted, accepted_tokens=accepted,
                        position_proposed=[drafted // 2, drafted // 2], position_accepted=[accepted // 2] * 2)
    report = JobReport(recipe="generic", model="m", input="in", output="shard", method="snapkv", budget=64,
                       device="cpu", tp=2, dp=2, rows_ok=rows_ok, latencies=latencies)
    summary = report.to_dict(stats)
    return summary, report, stats


def test_merged_report_adds_counts_and_recomputes_rates(tmp_path):
    parts = [group_part(3, 30, 2.0, 8, 10, [1.0, 2.0, 3.0]), group_part(2, 20, 4.0, 2, 10, [4.0, 5.0])]
    settled = shards.Settled(rows=1, failed=0)
    summary, exit_code = shards.merge_reports(parts, tmp_path / "out.jsonl", settled, dropped=[out_row("x")])
    job, th, sp = summary["job"], summary["throughput"], summary["speculative"]
    assert (job["rows"], job["rows_ok"], job["rows_failed"], job["rows_resumed"]) == (6, 5, 1, 1)
    assert exit_code == 1 and summary["duplicate_ids"] == ["x"]
    assert th["decode_tokens"] == 50 and th["decode_s"] == 4.0, "groups run at once: the longest one's time"
    assert th["decode_tokens_per_s"] == pytest.approx(12.5)
    assert (sp["draft_tokens"], sp["accepted_tokens"], sp["acceptance_rate"]) == (20, 10, 0.5)
    assert summary["latency"]["row_s"]["max"] == 5.0
    assert summary["data_parallel"]["rows_per_group"] == [3, 2]
    assert summary["hardware"]["dp"] == 2 and summary["job"]["output"].endswith("out.jsonl")


# ------------------------------------------------------------------ the supervisor


def sleeper(code_after: float | None = None, code: int = 0) -> subprocess.Popen:
    script = "import time, sys\n" + (f"time.sleep({code_after}); sys.exit({code})" if code_after is not None
                                     else "time.sleep(600)")
    return subprocess.Popen([sys.executable, "-c", script])


def test_supervisor_stops_everyone_when_one_worker_fails():
    procs = [sleeper(), sleeper(0.2, 3), sleeper()]
    with pytest.raises(launching.WorkersFailed) as failure:
        launching.supervise(procs)
    assert failure.value.exit_code == 3 and "rank 1 exited with code 3" in failure.value.message
    assert all(p.poll() is not None for p in procs), "no worker outlives the job"


def test_supervisor_returns_the_workers_code_when_all_finish():
    assert launching.supervise([sleeper(0.1, 0), sleeper(0.3, 1)]) == 1


# ------------------------------------------------------------------ end to end, 2 CPU processes


FAULTS = ROOT / "tests" / "faults"  # its sitecustomize kills a rank when asked (tests only)


def die_after_rows(rows: int) -> dict:
    """The environment that makes a rank other than 0 die (exit 9) after `rows` rows (tests/faults)."""
    return {"MAGICDEC_TEST_DIE_AFTER_ROWS": str(rows),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))}


def magicdec(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`magicdec run ...` in a fresh process, one thread per process (2 cores, 2 processes)."""
    full_env = {**os.environ, "MAGICDEC_THREADS": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "magicdec_cli.main", "run", *map(str, args)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def all_reduce_buffers() -> set[str]:
    """This user's DeepSpeed shared-memory all-reduce buffers now in /dev/shm (each is 67 MB of RAM)."""
    prefix = f"{shm_allreduce.BUFFER_PREFIX}_{os.getuid()}_"
    return {p.name for p in shm_allreduce.SHM_DIR.glob(prefix + "*")}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """method -> {id: text} of the one-process run (computed once per method)."""
    folder = tmp_path_factory.mktemp("single")
    data = write_jsonl(folder / "in.jsonl", ROWS)
    done: dict[str, dict] = {}

    def texts(method: str) -> dict:
        if method not in done:
            out = folder / f"{method}.jsonl"
            result = magicdec("generic", "-i", data, "-o", out, "--set", f"draft.method={method}", *JOB, "--quiet")
            assert result.returncode == 0, result.stderr
            done[method] = texts_by_id(out)
        return done[method]

    return texts


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("method", ["none", "streamingllm", "snapkv", "guided"])
def test_tp2_greedy_output_is_identical_to_one_process(tmp_path, single_process, method):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "tp2.jsonl"
    # A killed build's leftover: torch's builder would wait on it forever inside init_distributed.
    stale = shm_allreduce.extensions_dir() / shm_allreduce.OP_NAME / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.touch()
    buffers_before = all_reduce_buffers()
    result = magicdec("generic", "-i", data, "-o", out, "--tp", "2", "--set", f"draft.method={method}", *JOB, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # stdout holds exactly one JSON object, DeepSpeed's chatter is kept off it
    assert summary["hardware"]["tp"] == 2 and summary["job"]["rows_ok"] == len(ROWS)
    if method != "none":
        assert summary["speculative"]["draft_tokens"] > 0
    assert texts_by_id(out) == single_process(method)
    assert not stale.exists(), "the stale build lock was cleared"
    assert all_reduce_buffers() <= buffers_before, "the job left DeepSpeed's all-reduce buffers in /dev/shm"


@pytest.mark.slow
@pytest.mark.real_model
def test_dp2_writes_the_same_rows_once_with_one_merged_report(tmp_path, single_process):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "dp2.jsonl"
    result = magicdec("generic", "-i", data, "-o", out, "--dp", "2", "--set", "draft.method=none", *JOB, "--quiet")
    assert result.returncode == 0, result.stderr
    assert texts_by_id(out) == single_process("none")
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert (report["job"]["rows"], report["job"]["rows_ok"]) == (len(ROWS), len(ROWS))
    assert report["data_parallel"]["rows_per_group"] == [3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dp2.jsonl", "dp2.jsonl.manifest.json", "dp2.jsonl.report.json", "dp2.jsonl.report.md", "in.jsonl"]


@pytest.mark.slow
@pytest.mark.real_model
def test_killed_tensor_parallel_rank_ends_the_job_and_resume_completes_it(tmp_path, single_process):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "tp2.jsonl"
    # lookahead 1: requests are pulled as slots free up, so the follower meets a pull after 2 rows.
    args = ["generic", "-i", data, "-o", out, "--tp", "2", "--set", "draft.method=snapkv", *JOB,
            "--set", "batch.lookahead=1", "--quiet"]
    buffers_before = all_reduce_buffers()
    started = time.monotonic()
    killed = magicdec(*args, env=die_after_rows(2))
    assert time.monotonic() - started < 120, "the job must not hang when a rank dies"
    assert killed.returncode not in (0, 1), killed.stderr
    assert "rank 1 exited with code 9" in killed.stderr and "--resume" in killed.stderr
    kept = kept_rows(out)
    assert len(kept) >= 2, "the rows finished before the failure are kept"
    assert all_reduce_buffers() <= buffers_before, "a killed job left DeepSpeed's all-reduce buffers in /dev/shm"

    resumed = magicdec(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert texts_by_id(out) == single_process("snapkv")
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert report["job"]["rows_resumed"] == len(kept) and report["job"]["rows"] == len(ROWS)


@pytest.mark.slow
@pytest.mark.real_model
def test_killed_data_parallel_group_resumes_across_groups(tmp_path, single_process):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "dp.jsonl"
    args = ["generic", "-i", data, "-o", out, "--dp", "2", "--set", "draft.method=none", *JOB, "--quiet"]
    killed = magicdec(*args, env=die_after_rows(1))
    assert killed.returncode not in (0, 1), killed.stderr
    assert len(kept_rows(shards.shard_path(out, 1))) == 1, "group 1's finished row is kept in its shard"

    resumed = magicdec(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert texts_by_id(out) == single_process("none")
    assert shards.existing_shards(out) == []
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert report["job"]["rows"] == len(ROWS) and report["job"]["rows_resumed"] >= 1


@pytest.mark.slow
@pytest.mark.real_model
def test_two_nodes_under_deepspeeds_launcher(tmp_path, single_process):
    """Two DeepSpeed per-node launchers (what `deepspeed --hostfile` starts on each node over ssh) on this
    machine stand in for two nodes of 2 processes: tp 2 inside each node, dp 2 across them."""
    import base64

    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    world_info = base64.urlsafe_b64encode(json.dumps({"nodeA": [0, 1], "nodeB": [0, 1]}).encode()).decode()
    env = {**os.environ, "MAGICDEC_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    port = launching._free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", f"--node_rank={node}",
         "--master_addr=127.0.0.1", f"--master_port={port}", "--no_local_rank", "--module", "magicdec_cli.main",
         "run", "generic", "-i", str(data), "-o", str(out), "--tp", "2", "--set", "draft.method=streamingllm",
         *JOB, "--quiet"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    for node in nodes:
        _, stderr = node.communicate(timeout=RUN_TIMEOUT_S)
        assert node.returncode == 0, stderr[-3000:]
    assert texts_by_id(out) == single_process("streamingllm")
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert (report["hardware"]["tp"], report["hardware"]["dp"], report["job"]["rows"]) == (2, 2, len(ROWS))
