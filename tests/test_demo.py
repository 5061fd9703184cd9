"""The README's demo as a new user runs it, from a clean clone: what it writes is ignored by git, and
its report tells one time line that adds up, over a timeline spread across the job."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_demo() -> list[str]:
    """The demo: the first code block of the README, `scripts/setup && <the demo command>`."""
    block = re.search(r"```\n(.+?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S).group(1)
    setup, _, demo = block.partition(" && ")
    assert setup == "scripts/setup", block
    return shlex.split(demo)


def git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.real_model
def test_the_readme_demo_in_a_clean_clone_leaves_git_status_clean(tmp_path):
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("needs git and a git checkout")
    clone = tmp_path / "clone"
    git("clone", "--quiet", str(ROOT), str(clone), cwd=tmp_path)
    # What scripts/setup leaves in a checkout, without installing anything again: the environment
    # (here a link to this one) and the sample inputs.
    (clone / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    subprocess.run([sys.executable, "sample_data/build.py"], cwd=clone, check=True)
    demo = readme_demo()
    assert demo[:2] == [".venv/bin/magicdec", "run"], demo
    # The demo's own command, on one row and two tokens, with this clone's code (`-m` from its root).
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "magicdec_cli.main", *demo[1:], "--limit", "1",
                           "--set", "sampling.max_new_tokens=2"], cwd=clone, capture_output=True, text=True,
                          timeout=1200)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    output = clone / "sample_data" / "code.code.jsonl"
    written = {p.name[len(output.name):] for p in output.parent.glob(output.name + "*")}
    assert {"", ".manifest.json", ".report.json", ".report.md", ".report.png"} <= written, written
    assert git("status", "--porcelain", "--untracked-files=all", cwd=clone) == ""

    report = json.loads((clone / "sample_data" / "code.code.jsonl.report.json").read_text())
    times = report["time"]
    parts = [times[f"{name}_s"] for name in ("startup", "load", "prefill", "decode", "other")]
    assert all(part >= 0 for part in parts) and sum(parts) == pytest.approx(times["total_s"], rel=0.01)
    assert times["startup_s"] > 0, "the total counts from the process start (imports included)"
    assert times["total_s"] <= elapsed, "and not from before it"
    points = report["timeline"]
    assert points[0]["phase"] == "load" and points[-1]["phase"] == "end"
    from test_cli import assert_points_spread

    assert_points_spread(report, [json.loads(line) for line in output.read_text().splitlines()])
