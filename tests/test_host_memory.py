"""engine.core.host_memory: with it, a tensor freed and made again reuses its pages instead of faulting
them in afresh (counted by the kernel: the process's minor page faults), and the report says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# One "layer" of a 512-token prefill forward's activations on the 135M model's widths (hidden 576,
# MLP 1536: 1.2-3 MiB each, past glibc's default mmap threshold), made, filled and freed; after a warm-up,
# prints the minor page faults of 60 layers. With the defaults they fault ~2,000 pages a layer in again.
PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from engine.core.host_memory import keep_freed_pages
    print(keep_freed_pages(), file=sys.stderr)
    def layer():
        x = torch.empty(512, 576); x.fill_(1.0)  # [tokens, hidden]
        gate = torch.empty(512, 1536); gate.fill_(1.0)  # [tokens, intermediate]
        up = torch.empty(512, 1536); up.fill_(2.0)
        act = gate * up
        del gate, up
        out = torch.empty(512, 576); out.fill_(1.0)
        return float(act.sum() + out.sum() + x.sum())
    for _ in range(3):
        layer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(60):
        layer()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or "CS_GNU_LIBC_VERSION" not in os.confstr_names
                                or not os.confstr("CS_GNU_LIBC_VERSION"),
                                reason="mallopt thresholds are glibc's; this C library is not glibc")


def _faults(mode: str) -> tuple[int, str]:
    env = {**os.environ, "MAGICDEC_MALLOC": mode}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    return int(done.stdout.strip().splitlines()[-1]), done.stderr


@glibc_only
def test_freed_tensors_are_reused_not_faulted_in_again():
    kept, said = _faults("keep")
    default, _ = _faults("system")
    pages = 60 * 2 * (512 * 1536 * 4) // 4096  # the two MLP-wide tensors alone, every layer
    assert "kept" in said, said
    assert default > pages, f"the C library's defaults should fault the layers in ({default} faults)"
    assert kept < pages // 50, f"kept pages should not fault ({kept} faults against {default} with defaults)"


@glibc_only
def test_opting_out_leaves_the_defaults(monkeypatch):
    from engine.core import host_memory

    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.setenv("MAGICDEC_MALLOC", "system")
    try:
        assert host_memory.keep_freed_pages() == "system default"
    finally:
        monkeypatch.setattr(host_memory, "_state", None)
