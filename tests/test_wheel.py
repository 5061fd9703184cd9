"""The built wheel works on its own: shipped recipes are package data, found from any folder.

Builds the wheel from a copy of the sources (no network, no build isolation), installs it without
its dependencies into a fresh virtual environment that reuses this environment's installed packages
(a .pth file naming their folder: the new environment's own site-packages, holding the wheel, comes
first), and runs the installed `magicdec` from an empty temporary folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.mark.slow
@pytest.mark.real_model
def test_the_installed_wheel_finds_its_recipes_from_any_folder(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("engine", "magicdec_cli"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "-w", tmp_path / "dist", cwd=source)
    wheel = next((tmp_path / "dist").glob("magicdec-*.whl"))

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                .stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_magicdec_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel,
        cwd=tmp_path)

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run(python, "-c", "import engine, magicdec_cli; print(engine.__file__); print(magicdec_cli.__file__)",
                cwd=work).stdout.split()
    assert all(path.startswith(str(site)) for path in where), f"not the installed wheel: {where}"
    magicdec = venv / "bin" / "magicdec"
    listing = run(magicdec, "recipes", cwd=work).stdout
    assert [line.split()[0] for line in listing.splitlines()] == ["code", "docqa", "generic", "rag"]
    assert "method: snapkv" in run(magicdec, "recipes", "docqa", cwd=work).stdout
    (work / "docs.jsonl").write_text(json.dumps({"id": 1, "document": "The cat sat on the mat.",
                                                 "question": "Where did the cat sit?"}) + "\n")
    checked = json.loads(run(magicdec, "validate", "docqa", "--input", "docs.jsonl", "--json", cwd=work).stdout)
    assert (checked["recipe"], checked["rows"], checked["rows_ok"]) == ("docqa", 1, 1)
    assert checked["prompt_tokens"] > 10
