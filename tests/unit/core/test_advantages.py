"""Group-normalised advantages pinned to hand-computed values."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from core.advantages import group_advantages


def test_grpo_sample_std() -> None:
    # rewards [1, 0, 0, 1]: mean 0.5, deviations ±0.5, sample std sqrt(4*0.25/3) = 0.57735;
    # A = ±0.5 / 0.57735 = ±0.866025
    out = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    assert np.allclose(out.advantages, [a, -a, -a, a], atol=1e-12)
    assert np.allclose(out.group_std, math.sqrt(1 / 3))
    assert out.num_groups == 1 and out.num_zero_variance_groups == 0


def test_population_std_and_eps() -> None:
    # ddof = 0: std = 0.5, A = ±0.5 / (0.5 + eps)
    out = group_advantages([1.0, 0.0, 0.0, 1.0], ddof=0, eps=1e-6)
    a = 0.5 / (0.5 + 1e-6)
    assert np.allclose(out.advantages, [a, -a, -a, a], atol=1e-12)


def test_mean_only() -> None:
    # Dr. GRPO: A = r - mean = [0.5, -1.5, 1.0] for rewards [2, 0, 2.5] (mean 1.5)
    out = group_advantages([2.0, 0.0, 2.5], normalize_std=False)
    assert np.allclose(out.advantages, [0.5, -1.5, 1.0], atol=1e-12)


def test_groups_by_id_with_different_sizes() -> None:
    # group a: [1, 0] -> mean 0.5, sample std 0.7071, A = ±0.7071
    # group b: [3, 3, 3] -> zero variance, A = 0
    # group c: [5] -> a single sample is zero variance too
    rewards = [1.0, 3.0, 0.0, 3.0, 5.0, 3.0]
    ids = ["a", "b", "a", "b", "c", "b"]
    out = group_advantages(rewards, ids, eps=0.0)
    a = 0.5 / math.sqrt(0.5)
    assert np.allclose(out.advantages, [a, 0.0, -a, 0.0, 0.0, 0.0], atol=1e-12)
    assert out.zero_variance.tolist() == [False, True, False, True, True, True]
    assert out.num_groups == 3 and out.num_zero_variance_groups == 2
    assert np.allclose(out.group_mean, [0.5, 3.0, 0.5, 3.0, 5.0, 3.0])


def test_zero_variance_gives_exact_zeros_without_warnings() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: without the explicit rule, rounding noise
    # divided by eps would give advantages of order 1e-11.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for eps in (1e-6, 0.0):
            out = group_advantages([0.1, 0.1, 0.1], eps=eps)
            assert out.advantages.tolist() == [0.0, 0.0, 0.0]
            assert out.num_zero_variance_groups == 1


def test_atol_treats_near_constant_groups_as_zero_variance() -> None:
    out = group_advantages([1.0, 1.0 + 1e-9], atol=1e-6)
    assert out.advantages.tolist() == [0.0, 0.0]
    assert out.num_zero_variance_groups == 1
    out = group_advantages([1.0, 1.0 + 1e-9])
    assert out.num_zero_variance_groups == 0


def test_advantages_sum_to_zero_per_group() -> None:
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=40)
    ids = rng.integers(0, 5, size=40)
    out = group_advantages(rewards, ids)
    for g in range(5):
        assert abs(out.advantages[ids == g].sum()) < 1e-9
        assert np.isclose(np.std(out.advantages[ids == g], ddof=1), 1.0, atol=1e-4)


def test_empty_and_invalid_inputs() -> None:
    out = group_advantages([])
    assert out.advantages.size == 0 and out.num_groups == 0
    with pytest.raises(ValueError):
        group_advantages([[1.0, 2.0]])
    with pytest.raises(ValueError):
        group_advantages([1.0, math.nan])
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], ddof=2)
