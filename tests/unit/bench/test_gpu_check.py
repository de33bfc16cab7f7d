"""The GPU check's CPU fallback: everything ``python -m bench.gpu_check`` does on a GPU
that a CPU can do, on the tiny model (the real check runs where a GPU is, never in CI)."""

from __future__ import annotations

import pytest

from bench import gpu_check, gpu_engine, gpu_roles


def test_the_old_logit_pass_matches_its_independent_recompute() -> None:
    report = gpu_check.check("cpu", "tiny", rows=4, prompt=16, response=24, repeats=1)
    assert report.passed
    assert report.max_abs_diff_vs_solo["float32"] <= gpu_check.FLOAT32_ROUNDING
    assert all(report.state_dict_path_bitwise_equal.values())
    assert report.max_abs_diff_device_vs_cpu_fp32 is None  # the device is the CPU


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_and_trainer_agree_across_a_step_and_the_host_tier(dtype: str) -> None:
    report = gpu_roles.check("cpu", "tiny", dtype, groups=2, prompt_len=8, response_len=24)
    assert report.v0_logp_old_equals_trainer and report.v1_logp_old_equals_trainer
    assert report.weights_moved and report.loss == report.loss  # finite, not NaN
    assert report.v0_from_host_tier_unchanged
    assert report.held_after_v1["host_versions"] == (0,)
    assert report.held_after_v1["device_versions"] == (1,)
    assert report.passed


def test_a_device_that_is_not_there_is_refused() -> None:
    with pytest.raises(ValueError, match="device"):
        gpu_roles.check("gpu")


def test_the_served_engine_matches_the_old_logit_pass_and_follows_a_version() -> None:
    report = gpu_engine.check("cpu", "tiny", "cpu", rows=4, tokens=16, timeout_s=120)
    assert report.followed_version_1
    assert max(report.max_abs_diff_v0, report.max_abs_diff_v1) <= gpu_engine.CPU_ENGINE_TOLERANCE
    assert report.generated_tokens == 4 * 16 and report.passed


def test_sglang_missing_is_said_with_how_to_install_it() -> None:
    with pytest.raises(RuntimeError, match=r"sglang is not installed.*pip install"):
        gpu_engine.check("sglang", "tiny", "cpu", rows=1, tokens=1, timeout_s=60)


def test_two_trainer_ranks_end_bit_identical() -> None:
    report = gpu_check.run_ranks(2, "cpu", "tiny", "float32")
    assert (report["ranks"], report["backend"]) == (2, "gloo")
    assert report["weights_moved"] and report["ranks_bit_identical"] and report["passed"]
