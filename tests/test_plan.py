"""The roofline planner (engine.plan): contract keys, the cost model's shape, and the paper's trends."""

from __future__ import annotations

import pytest

from engine.errors import JobError
from engine.spec.gamma import best_gamma, relative_time
from engine.models.shapes import linear_params, normalize_shapes, shapes_for
from engine.planning.hardware import HARDWARE, hardware_profile, measure_hardware
from engine.planning.paper import ACCEPTANCE_PG19, PAPER_CHECKS, paper_rows, paper_tables_markdown
from engine.planning.roofline import plan

LLAMA_8B = shapes_for("llama-3.1-8b")
CONTRACT_KEYS = ("gamma", "predicted_speedup", "acceptance", "t_target_ms", "t_draft_ms", "t_verify_ms")


def run(**overrides):
    args = dict(shapes=LLAMA_8B, hardware=hardware_profile("h100"), batch=64, context=32768,
                method="streamingllm", budget=512, acceptance=0.8)
    args.update(overrides)
    return plan(**args)


def test_contract_keys_and_per_gamma_lists():
    result = run()
    for key in CONTRACT_KEYS:
        assert key in result, f"plan result lacks contract key {key!r}"
    assert isinstance(result["gamma"], int)
    assert result["acceptance"] == 0.8
    g = result["gamma"]
    assert result["expected_acceptance_rate"] == pytest.approx((result["expected_tokens"] - 1) / g)
    assert result["gammas"] == list(range(1, 9)), "default gamma_max is 8"
    assert len(result["t_verify_ms_by_gamma"]) == len(result["speedup_by_gamma"]) == 8
    assert result["t_verify_ms"] == result["t_verify_ms_by_gamma"][result["gamma"] - 1]
    inputs = result["inputs"]
    assert (inputs["batch"], inputs["context"], inputs["method"], inputs["budget"], inputs["tp"]) == (
        64, 32768, "streamingllm", 512, 1)
    assert result["hardware"]["name"] == "H100-SXM"


def test_display_rows_are_label_value_strings():
    from magicdec_cli.tables import display_rows

    rows = display_rows(run(method="pqcache"))
    assert rows and all(isinstance(label, str) and isinstance(value, str) for label, value in rows)
    assert any("search" in value for _, value in rows), "pqcache shows its search time"


def test_verify_costs_grow_with_gamma_and_exceed_a_decode_step():
    result = run()
    by_gamma = result["t_verify_ms_by_gamma"]
    assert all(a <= b for a, b in zip(by_gamma, by_gamma[1:])), f"T_V(g) must not shrink with g: {by_gamma}"
    assert by_gamma[0] >= result["t_target_ms"], "verifying 2 tokens cannot be cheaper than decoding 1"


def test_best_gamma_is_engine_gamma_best_gamma_on_the_predicted_times():
    result = run(batch=16, context=16384)
    verify = [t / 1e3 for t in result["t_verify_ms_by_gamma"]]
    expected = best_gamma(0.8, result["t_draft_ms"] / 1e3, lambda g: verify[g - 1], result["t_target_ms"] / 1e3, 8)
    assert result["gamma"] == expected[0]
    assert result["predicted_speedup"] == pytest.approx(expected[1])
    assert result["predicted_speedup"] == pytest.approx(max(1.0, *result["speedup_by_gamma"]))


def test_long_context_large_batch_speculates_and_beats_short_context_small_batch():
    long_ = run(batch=64, context=32768)
    short = run(batch=1, context=512)
    assert long_["gamma"] >= 2, f"B=64 x 32K on H100 should speculate with gamma >= 2, got {long_['gamma']}"
    assert long_["predicted_speedup"] > short["predicted_speedup"], (long_, short)
    assert long_["target_bound"] == "memory"


def test_fixed_gamma_is_evaluated_as_given():
    fixed = run(gamma=2)
    assert fixed["gamma"] == 2 and fixed["gamma_fixed"]
    rel = relative_time(2, 0.8, fixed["t_draft_ms"], fixed["t_verify_ms"], fixed["t_target_ms"])
    assert fixed["predicted_speedup"] == pytest.approx(1 / rel)
    assert fixed["predicted_speedup"] == pytest.approx(fixed["speedup_by_gamma"][1])
    beyond = run(gamma=12)
    assert beyond["gamma"] == 12 and len(beyond["t_verify_ms_by_gamma"]) == 12


def test_no_speculation_when_it_does_not_pay():
    hopeless = run(batch=1, context=512, acceptance=0.05)
    assert hopeless["gamma"] == 0 and hopeless["predicted_speedup"] == 1.0
    assert hopeless["t_verify_ms"] == hopeless["t_verify_ms_by_gamma"][0], "gamma 0 reports T_V at gamma 1"
    plain = run(method="none")
    assert plain["gamma"] == 0 and plain["predicted_speedup"] == 1.0


def test_paper_8xa100_gamma2_slower_at_4k_and_faster_with_context():
    hw = hardware_profile("a100")

    def speedup(batch, context):
        return plan(shapes=LLAMA_8B, hardware=hw, batch=batch, context=context, method="streamingllm",
                    budget=512, acceptance=ACCEPTANCE_PG19[context], tp=8, gamma=2)["predicted_speedup"]

    for batch in (32, 64, 128, 256):
        assert speedup(batch, 4000) < 1.0, f"the paper measured a slowdown at 4K, batch {batch}"
    for batch in (32, 64, 128):
        curve = [speedup(batch, context) for context in (4000, 8000, 16000, 32000)]
        assert all(a < b for a, b in zip(curve, curve[1:])), f"speedup must grow with context at batch {batch}: {curve}"
    long_curve = [speedup(32, context) for context in (32000, 64000, 100000)]
    assert 1.0 < long_curve[0] < long_curve[1] < long_curve[2], long_curve


def test_paper_rows_and_markdown_tables():
    rows = paper_rows(0)
    assert {(r["context"], r["batch"]) for r in rows} >= {(4000, 32), (4000, 256), (32000, 32), (100000, 32)}
    assert all(r["gamma"] == 2 for r in rows), "the first check evaluates gamma 2 as the paper's Table 3 fixed it"
    for check in range(len(PAPER_CHECKS)):
        for r in paper_rows(check):
            assert r["roofline_only"] > r["predicted"], "fixed costs can only lower the predicted speedup"
            if r["error"] is not None:
                assert abs(r["error"]) < 0.3, f"prediction far off the paper in check {check}: {r}"
    tables = paper_tables_markdown()
    assert tables.count("| 100000 | 32 |") == 1 and tables.count("**Llama-3.1-8B") == len(PAPER_CHECKS)


def test_pqcache_search_grows_with_batch_times_context_faster_than_streamingllm():
    def draft_ms(method, batch, context):
        return run(method=method, batch=batch, context=context)["t_draft_ms"]

    small, large = (8, 4096), (64, 32768)
    growth = {m: draft_ms(m, *large) / draft_ms(m, *small) for m in ("streamingllm", "snapkv", "pqcache")}
    assert growth["pqcache"] > growth["streamingllm"], growth
    assert growth["snapkv"] == pytest.approx(growth["streamingllm"]), "snapkv selects at prefill only"
    assert run(method="pqcache", context=256)["t_select_ms"] == 0.0, "no search while the row fits the budget"
    assert 0.0 < run(method="pqcache", pq_search="fused")["t_select_ms"] < run(method="pqcache")["t_select_ms"]


def test_guided_drafts_like_streamingllm_and_adds_a_little_to_verification():
    for batch, context in ((8, 4096), (64, 32768)):
        guided, streaming = run(method="guided", batch=batch, context=context), run(method="streamingllm",
                                                                                     batch=batch, context=context)
        assert guided["t_draft_ms"] == pytest.approx(streaming["t_draft_ms"])
        extra = [g / s - 1 for g, s in zip(guided["t_verify_ms_by_gamma"], streaming["t_verify_ms_by_gamma"])]
        assert all(0.0 < x < 0.06 for x in extra), extra  # mass 4 B + top-k 20 B vs 512 B of K/V per position
        assert guided["t_round_select_ms"] > 0 and streaming["t_round_select_ms"] == 0.0


def test_pq_search_bytes_per_position():
    from engine.planning.roofline import pq_search_bytes

    assert pq_search_bytes(16, 8, "fused") == 16 + 4 + 4 * 4
    assert pq_search_bytes(16, 8, "torch") == 16 * (3 + 8 + 8 + 4 + 4) + 12 + 4 * 4
    assert pq_search_bytes(16, 10, "fused") == 32 + 20, "codes wider than 8 bits take 2 bytes"


def test_tensor_parallel_splits_work_but_pays_communication():
    one = run(batch=32, context=32768)
    eight = run(batch=32, context=32768, tp=8)
    assert one["t_target_ms"] / 8 < eight["t_target_ms"] < one["t_target_ms"]
    assert eight["breakdown_ms"]["target"]["comm"] > 0.0 and one["breakdown_ms"]["target"]["comm"] == 0.0


def test_separate_draft_model_is_cheaper_than_self_speculation_at_short_context():
    self_spec = run(batch=4, context=2048)
    small_draft = run(batch=4, context=2048, draft_shapes=shapes_for("llama-3.2-1b"))
    assert small_draft["t_draft_ms"] < self_spec["t_draft_ms"]
    assert small_draft["t_target_ms"] == pytest.approx(self_spec["t_target_ms"])


def test_shapes_match_model_shapes_and_llama_8b_parameter_count():
    from engine.models.loading import model_shapes

    read = model_shapes("llama-3.1-8b-shape")
    ours = shapes_for("llama-3.1-8b")
    for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
        assert ours[key] == read[key], key
    assert normalize_shapes(read)["hidden"] == 4096
    # 8.03B parameters minus the 0.53B input embedding (the lm_head is separate in Llama-3.1-8B).
    assert linear_params(ours) == pytest.approx(7.50e9, rel=0.01)


def test_hardware_profiles_by_name():
    for name in ("a100", "H100", "h200", "L40", "A100-80GB"):
        profile = hardware_profile(name)
        assert profile["mem_bw"] > 0 and profile["flops"] > 0 and 0 < profile["bw_eff"] <= 1
    assert set(HARDWARE) == {"a100", "h100", "h200", "l40"}
    profile = hardware_profile("a100")
    profile["mem_bw"] = 1.0
    assert hardware_profile("a100")["mem_bw"] == 2.0e12, "profiles are copies"
    with pytest.raises(JobError, match="h100"):
        hardware_profile("h1000")


def test_bad_inputs_are_one_line_job_errors():
    with pytest.raises(JobError, match="method"):
        run(method="quest")
    with pytest.raises(JobError, match="acceptance"):
        run(acceptance=1.0)
    with pytest.raises(JobError, match="batch"):
        run(batch=0)
    with pytest.raises(JobError, match="link_bw"):
        run(hardware={k: v for k, v in hardware_profile("h100").items() if k != "link_bw"})
    with pytest.raises(JobError, match="pq_search"):
        run(method="pqcache", pq_search="cuda")


def test_measure_hardware_returns_positive_numbers():
    hw = measure_hardware(seconds_hint=1.0)
    for key in ("mem_bw", "flops", "link_bw", "layer_latency_s", "step_overhead_s"):
        assert hw[key] > 0, key
    result = plan(shapes=shapes_for("tiny"), hardware=hw, batch=2, context=64, method="streamingllm",
                  budget=32, acceptance=0.8, dtype_bytes=4)
    assert result["t_target_ms"] > 0 and result["t_draft_ms"] > 0
