"""`validate` and `run` give every row the same verdict: one rows -> requests path (engine.job.requests).

The same file of good and bad rows (a malformed line, a missing template column, a prompt too long for
its slot, a duplicate id, OpenAI batch rows with their custom_id, good and bad, rows with good and bad
sampling values of their own) goes through
`magicdec validate` and `magicdec run`; the rows validate calls bad are exactly the run's error
records (same message) and duplicates, and the rest are generated.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from magicdec_cli.main import app

runner = CliRunner()
LONG = "word " * 400  # ~400 tokens: too long for batch.max_len 256


def test_validate_and_run_agree_row_by_row(tmp_path):
    lines = [
        json.dumps({"id": "good", "prompt": "The capital of France is"}),
        "{not json",
        json.dumps({"id": "no-prompt", "text": "a row without the template's column"}),
        json.dumps({"id": "long", "prompt": LONG}),
        json.dumps({"id": "good", "prompt": "the same id again"}),
        json.dumps({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions", "body": "not an object"}),
        json.dumps({"custom_id": "comp-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "1, 2, 3,"}}),
        json.dumps([1, 2, 3]),
        # Per-row sampling: good and bad values from a body and from the columns the recipe names.
        json.dumps({"custom_id": "sampled", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "Once upon a time", "temperature": 0.8, "top_p": 0.9, "seed": 4,
                             "max_tokens": 2}}),
        json.dumps({"custom_id": "cold", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "temperature": -1}}),
        json.dumps({"id": "own-len", "prompt": "One, two,", "temp": 0.7, "n": 1}),
        json.dumps({"id": "bad-len", "prompt": "One, two,", "n": "five"}),
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    settings = ["--set", "batch.size=2", "--set", "batch.max_len=256", "--set", "sampling.max_new_tokens=3",
                "--set", "draft.method=none", "--set", "input.sampling_columns={temperature: temp, max_new_tokens: n}"]

    checked = runner.invoke(app, ["validate", "generic", "--input", str(data), "--json", *settings])
    assert checked.exit_code == 1, checked.output
    verdict = json.loads(checked.stdout)
    problems = {(p["row"], str(p["id"])): p["error"] for p in verdict["problems"]}
    duplicates = {key for key, error in problems.items() if error.startswith("duplicate id")}

    out = tmp_path / "out.jsonl"
    ran = runner.invoke(app, ["run", "generic", "--input", str(data), "--output", str(out), "--json", *settings])
    assert ran.exit_code == 1, ran.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = {str(r["id"]): r["error"] for r in rows if r["finish_reason"] == "error"}
    generated = {str(r["id"]) for r in rows if r["finish_reason"] != "error"}
    report = json.loads(ran.stdout)

    assert {row_id: error for (_, row_id), error in problems.items() if (_, row_id) not in duplicates} == errors
    assert [row_id for _, row_id in duplicates] == [str(x) for x in report["duplicate_ids"]] == ["good"]
    assert generated == {"good", "chat-1", "comp-1", "sampled", "own-len"}
    lengths = {str(r["id"]): r["output_tokens"] for r in rows}
    assert lengths["sampled"] == 2 and lengths["own-len"] == 1 and lengths["good"] == 3
    # The ids run wrote for unreadable rows are those validate named: the OpenAI rows' own custom_id,
    # else the row number, as a string like the input's other ids.
    assert {"bad-url", "bad-body", "1", "9", "no-prompt", "long", "cold", "bad-len"} == set(errors)
    assert errors["bad-len"] == "column 'n' (sampling.max_new_tokens) must be an integer, got 'five'"
    assert verdict["rows"] == len(lines) and verdict["rows_bad"] == len(errors) + len(duplicates)
