"""Up to how many rows the AVX-512 GGUF panels take a call (`engine.core.panel_rows`, `engine.core.linear`).

The rule against hand-made timings, the kept measurement (measured once, then read back), the
environment's setting, and on a machine whose kernel reads panels: the real measurement's shape, and
a call past `max_rows()` within the limit computed by the panels (a row's bits the same alone as in
its batch, and the product's to float32 rounding), beyond it by torch's GEMM.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_panel_call
from engine.core import linear as engine_linear
from engine.core import panel_rows
from engine.core.kernels import load as load_kernels
from engine.errors import JobError
from engine.models.gguf_blocks import PackedWeight, dequantise, to_panels


def test_the_limit_is_the_last_row_count_before_torch_wins():
    win, lose = (1.0, 2.0), (2.0, 1.0)
    ladder = [48, 64, 96, 128]
    assert panel_rows.limit_from_timings([(r, *win) for r in ladder], floor=40) == math.inf
    assert panel_rows.limit_from_timings([(48, *lose), (64, *win)], floor=40) == 40  # lost at once: the floor
    assert panel_rows.limit_from_timings([(48, *win), (64, *win), (96, *lose), (128, *win)], floor=40) == 64
    tie = (1.04, 1.0)  # within 5%: the panels keep the rows (same speed, batch-independent bits)
    assert panel_rows.limit_from_timings([(48, *win), (64, *tie), (96, 1.06, 1.0)], floor=40) == 64
    assert panel_rows.limit_from_timings([(48, *win), (64, *lose)], floor=128) == 128  # never below the floor


class FakeKernel:
    __name__ = "fake_kernel_for_panel_rows"


def test_the_measurement_is_taken_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(panel_rows.ENV, raising=False)
    calls = []

    def measure(kernel, panel_format):
        calls.append(panel_format)
        return [(48, 1.0, 2.0), (64, 1.0, 2.0), (96, 3.0, 2.0)]

    monkeypatch.setattr(panel_rows, "measure", measure)
    assert panel_rows.row_limit(FakeKernel(), 3, floor=40) == 64
    assert panel_rows.row_limit(FakeKernel(), 3, floor=40) == 64
    assert calls == [3]  # the second answer was read back, not measured
    kept = panel_rows._kept_at(FakeKernel())
    assert kept.is_relative_to(tmp_path) and json.loads(kept.read_text())["limit"] == 64
    kept.write_text(json.dumps({"limit": None, "timings": []}))  # "every count": kept as null
    assert panel_rows.row_limit(FakeKernel(), 3, floor=40) == math.inf
    kept.write_text("not json")  # a damaged file is measured again
    assert panel_rows.row_limit(FakeKernel(), 3, floor=40) == 64 and calls == [3, 3]


def test_the_environment_sets_the_limit_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(panel_rows, "measure", lambda *a: pytest.fail("measured despite the setting"))
    for setting, want in (("all", math.inf), ("96", 96), ("8", 40)):  # never below the floor
        monkeypatch.setenv(panel_rows.ENV, setting)
        assert panel_rows.row_limit(FakeKernel(), 3, floor=40) == want
    for bad in ("many", "-5", "1.5"):  # one line naming the variable, not a traceback
        monkeypatch.setenv(panel_rows.ENV, bad)
        with pytest.raises(JobError, match=f"{panel_rows.ENV}='{re.escape(bad)}': expected a row count or 'all'"):
            panel_rows.row_limit(FakeKernel(), 3, floor=40)


@pytest.fixture
def fma_panels(tmp_path, monkeypatch):
    module = load_kernels()
    if module is None or engine_linear.FORMATS["q4_1_panels"] not in module.small_linear_formats():
        pytest.skip("the kernel reads GGUF panels only where it is built with AVX-512")
    if not engine_linear.kernel_in_use():
        pytest.skip("the few-row kernel is switched off (MAGICDEC_SMALL_GEMM=0)")
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    previous = module.use_amx(False)  # the AVX-512 FMAs' panels, whose limit is measured
    yield module
    module.use_amx(previous)


def test_a_real_measurement_times_both_at_every_row_count(fma_panels):
    timings = panel_rows.measure(fma_panels, engine_linear.FORMATS["q4_1_panels"])
    assert [rows for rows, _, _ in timings] == list(panel_rows.LADDER)
    assert all(p > 0 and t > 0 for _, p, t in timings)


def test_panel_calls_take_the_kernel_up_to_the_limit_and_torch_beyond(fma_panels, monkeypatch):
    blocks = panel_rows.synthetic_q4_1(32, 64)
    weight, packed = dequantise(blocks, "q4_1"), PackedWeight("q4_1_panels", to_panels(blocks, "q4_1"))
    g = torch.Generator().manual_seed(3)
    rows = engine_linear.max_rows() + 8  # a verification forward's rows, past the few-row limit
    x = torch.randn(rows, 64, generator=g)
    monkeypatch.setitem(engine_linear._state, "panel_rows", rows)
    got = engine_linear.linear(x, weight, None, packed)
    assert_panel_call(got, x, weight, lambda rows_x: engine_linear.linear(rows_x, weight, None, packed))
    monkeypatch.setitem(engine_linear._state, "panel_rows", rows - 1)  # one row past the limit: torch
    assert torch.equal(engine_linear.linear(x, weight, None, packed), F.linear(x, weight))
    float32_only = engine_linear.linear(x, weight, None, None)  # no panels: the few-row limit still holds
    assert torch.equal(float32_only, F.linear(x, weight))
