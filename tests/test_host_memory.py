"""engine.core.host_memory: with it, a tensor freed and made again reuses its pages instead of faulting
them in afresh (counted by the kernel: the process's minor page faults), and the report says so.

The baseline is not glibc's defaults as they happen to fall: its mmap threshold adapts to the blocks
freed so far, so whether the probe's layers fault with the defaults depends on the C library and the
machine (CI once read 0 faults with them). The probe's baseline fixes the threshold at glibc's initial
128 KiB instead, which returns every activation to the kernel when freed; if even that faults no pages
(a kernel that backs them with huge pages or does not count minor faults), the test skips and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# One "layer" of a 512-token prefill forward's activations on the 135M model's widths (hidden 576,
# MLP 1536: 1.2-3 MiB each, past glibc's default mmap threshold), made, filled and freed; after a warm-up,
# prints the minor page faults of 60 layers. Handed back to the kernel on free (argv "unmap-on-free"),
# they fault ~2,000 pages a layer in again; kept (the code's setting), none.
PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    import torch
    from engine.core.host_memory import M_MMAP_THRESHOLD, keep_freed_pages
    print(keep_freed_pages(), file=sys.stderr)
    if sys.argv[1] == "unmap-on-free":  # glibc's initial threshold, fixed (so it no longer adapts)
        assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
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
    """Minor faults of the probe's 60 layers, and what it printed: mode "keep" (the code's setting) or
    "unmap-on-free" (the C library's, with every activation handed back to the kernel when freed)."""
    env = {**os.environ, "MAGICDEC_MALLOC": "keep" if mode == "keep" else "system"}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True)
    return int(done.stdout.strip().splitlines()[-1]), done.stderr


@glibc_only
def test_freed_tensors_are_reused_not_faulted_in_again():
    pages = 60 * 2 * (512 * 1536 * 4) // os.sysconf("SC_PAGE_SIZE")  # the two MLP-wide tensors alone
    unmapped, _ = _faults("unmap-on-free")
    if unmapped < pages // 4:
        pytest.skip(f"this kernel counted {unmapped} minor faults for {pages}+ freshly mapped pages "
                    "(huge pages, or faults not counted): nothing to compare against")
    kept, said = _faults("keep")
    assert "kept" in said, said
    assert kept < pages // 50, f"kept pages should not fault ({kept} faults against {unmapped} unmapped on free)"


@glibc_only
def test_opting_out_leaves_the_defaults(monkeypatch):
    from engine.core import host_memory

    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.setenv("MAGICDEC_MALLOC", "system")
    try:
        assert host_memory.keep_freed_pages() == "system default"
    finally:
        monkeypatch.setattr(host_memory, "_state", None)
