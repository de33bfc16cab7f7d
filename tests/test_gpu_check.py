"""The GPU check's CPU fallback: everything ``python -m bench.gpu_check`` does on a GPU
that a CPU can do, on the tiny model (the real check runs where a GPU is, never in CI)."""

from __future__ import annotations

import pytest

from bench import gpu_check, gpu_roles


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
