"""The fused CPU kernels (`engine/core/csrc`: decode/verify/draft attention, chunked-prefill attention,
the lean draft's small ops, the guided view's selection, PQCache's codes and the few-row linear map),
compiled once per machine on first use.

torch's C++ extension builder compiles them with the host's vector instructions (-march=native) into
the cache folder, keyed by the sources and the CPU's flags, so a shared home directory never loads a
build made for another CPU. If no compiler is available (or MAGICDEC_CPU_KERNEL=0), `load()` returns
None and the engine uses the pure-torch attention, which gives the same results more slowly; with
`MAGICDEC_REQUIRE_KERNEL=1` (the test suite sets it wherever a compiler exists, and under `CI=true`) a
failed build raises instead, so it cannot hide behind the fallback. A build is announced as a step
(`engine.steps`: a line when it starts, one with its time; about 3 minutes on 2 cores). This module
builds and loads; the attention module decides when to call the kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

from engine.cache_dir import cache_root, file_lock
from engine.steps import step, waiting

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("cpu_attention.cpp", "cpu_prefill.cpp", "cpu_draft_ops.cpp", "cpu_guided.cpp",
                        "cpu_linear.cpp", "cpu_pqcache.cpp", "cpu_bf16_linear.cpp",
                        "cpu_int8_panels.cpp")]
# included by the sources, copied beside them
HEADERS = [Path(__file__).with_name("csrc") / name for name in ("vector_math.h", "amx_tiles.h", "panel_tasks.h")]
AMX_ENV = "MAGICDEC_AMX"  # "0": no AMX tiles (GEMM panels by AVX-512 FMAs, prefill attention by the vector task)
BF16_DOT_ENV = "MAGICDEC_BF16_DOT"  # "0": a bfloat16 model's prefill attention widens to float32 FMAs
BF16_GEMM_ENV = "MAGICDEC_BF16_GEMM"  # "0": a bfloat16 model's linears keep torch's GEMM (engine.core.linear)
INT8_PANELS_ENV = "MAGICDEC_INT8_PANELS"  # "0": a draft's int8 GEMMs by fbgemm even where GGUF panels are kept
REQUIRE_ENV = "MAGICDEC_REQUIRE_KERNEL"  # "1": a failed build raises instead of falling back to torch
_state: dict[str, object] = {}
log = logging.getLogger(__name__)


def _cpuinfo_line(field: str) -> str | None:
    """The first line of /proc/cpuinfo starting with `field`, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    return _cpuinfo_line("flags") or platform.processor()


def bf16_gemm_wanted() -> bool:
    """Whether a bfloat16 model's decode GEMMs should take the kernel's bfloat16 dot products here: the
    CPU has AVX512-BF16 but no AMX tiles (there torch's GEMM has them; not measured against this), and
    `MAGICDEC_BF16_GEMM` is not "0". Read without building the kernel (the memory check asks too)."""
    flags = cpu_flags().split()
    return os.environ.get(BF16_GEMM_ENV, "1") != "0" and "avx512_bf16" in flags and "amx_bf16" not in flags


def int8_panels_wanted() -> bool:
    """Whether a draft's int8 GEMMs take a GGUF model's own panels here (`engine.core.linear.int8_panel_map`):
    the CPU has AVX512-VNNI and AVX512-VBMI and `MAGICDEC_INT8_PANELS` is not "0". Read without
    building the kernel (the memory check asks too)."""
    flags = cpu_flags().split()
    return os.environ.get(INT8_PANELS_ENV, "1") != "0" and "avx512_vnni" in flags and "avx512vbmi" in flags


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", ...), else the platform's word for it."""
    line = _cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or "cpu"


def compiler_available() -> bool:
    """Whether a C++ compiler torch's extension builder would use is on this machine."""
    return any(shutil.which(name) for name in (os.environ.get("CXX") or "c++", "g++", "clang++"))


def load():
    """The compiled module, or None when it cannot be built here (the reason is logged once)."""
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("MAGICDEC_CPU_KERNEL", "1") != "0":
        try:
            module = _build()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back to torch
            if os.environ.get(REQUIRE_ENV) == "1":
                raise RuntimeError(f"the fused CPU kernel failed to build ({REQUIRE_ENV}=1)") from exc
            log.warning("fused CPU attention unavailable, using the torch path: %s",
                        str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
    if module is not None and os.environ.get(AMX_ENV, "1") == "0":
        module.use_amx(False)
    if module is not None and os.environ.get(BF16_DOT_ENV, "1") == "0":
        module.prefill_use_bf16_dot(False)
    _state["module"] = module
    return module


def _build():
    import torch
    from torch.utils.cpp_extension import load as load_extension

    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + cpu_flags().encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"magicdec_cpu_attention_{key}"
    build_dir = cache_root() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
    # Data-parallel ranks (or other jobs sharing the cache) may start together: one builds, the rest wait.
    with file_lock(build_dir / "build.lock", on_wait=waiting(f"to finish with the fused CPU kernels in {build_dir}")):
        # torch's builder marks a build in progress with a `lock` file and waits while one exists; a
        # process killed mid-build leaves it behind. Holding our lock, no other build can be running.
        (build_dir / "lock").unlink(missing_ok=True)
        # Build from copies inside the (content-keyed) folder: two checkouts with the same sources at
        # different paths then share one build instead of rebuilding it for each other.
        sources = []
        for path in SOURCES + HEADERS:
            copy = build_dir / path.name
            if not copy.is_file() or copy.read_bytes() != path.read_bytes():
                copy.write_bytes(path.read_bytes())
            if path in SOURCES:
                sources.append(str(copy))
        with contextlib.ExitStack() as announced:
            if not (build_dir / f"{name}.so").is_file():  # else torch only loads what was built before
                announced.enter_context(step(f"compiling the fused CPU kernels once into {build_dir} "
                                             "(about 3 minutes on 2 cores)", "compiled the fused CPU kernels"))
            return load_extension(name=name, sources=sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  build_directory=str(build_dir), verbose=False)
