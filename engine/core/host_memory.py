"""Keep freed host memory in the process, so a prefill's activations stop page-faulting afresh.

torch allocates CPU tensors with the C library's malloc. glibc hands a block above its mmap threshold
(dynamic, from 128 KiB) straight back to the kernel when it is freed, and trims the heap's free top
above its trim threshold; either way the next tensor of that size faults its pages in again, each
one zeroed by the kernel. A prefill forward of 512 tokens makes and frees dozens of 1-10 MiB
activations per layer, so a long-document job spends seconds in those faults (measured on the
2-vCPU Zen 4: 1.48 M minor faults and 7.0 s of system time in an 81 s docQA job; BENCHMARKS.md
section 24). `keep_freed_pages` raises both thresholds once for the process (glibc's `mallopt`), so
freed activations are reused from the heap; blocks above the mmap ceiling (32 MiB) still go back.
The resident peak does not grow: what is kept is what the previous forward already had resident.
`MAGICDEC_MALLOC=system` leaves the C library's defaults (to measure the difference).

Not here: the KV cache and the prefix store, which are allocated once and touched as they fill
(`engine.core.kv_cache`), and any other allocator (musl, macOS, CUDA), where this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**31 - 1  # the largest an int takes: the heap's free top is kept (the next forward's)

_state: str | None = None


def keep_freed_pages() -> str:
    """Set glibc's thresholds once per process; returns what this process's malloc now does (for the report)."""
    global _state
    if _state is None:
        _state = _apply()
    return _state


def current() -> str:
    """What `keep_freed_pages` did in this process ("-": not called, e.g. a CUDA job)."""
    return _state or "-"


def _apply() -> str:
    if os.environ.get("MAGICDEC_MALLOC") == "system" or not sys.platform.startswith("linux"):
        return "system default"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):  # not glibc (musl has no gnu_get_libc_version)
        return "system default"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return f"glibc {version}, default thresholds (mallopt refused)"
    return f"glibc {version}, freed blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB kept"
