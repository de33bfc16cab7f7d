"""Group-normalised advantages (GRPO), pure numpy so that stream processors need no torch.

For the rewards ``r_1..r_K`` of one group (the samples of one prompt)::

    A_i = (r_i - mean(r)) / (std(r) + eps)     normalize_std=True (GRPO)
    A_i =  r_i - mean(r)                       normalize_std=False (Dr. GRPO, mean only)

``std`` uses ``ddof`` (1: the sample std, as TRL and verl compute it; 0: the population
std). A *zero-variance group* is one whose rewards are all equal (max - min <= ``atol``),
including a group of one sample: it carries no learning signal, all its advantages are
set to exactly 0 (rather than rounding noise divided by eps), and it is reported so that
the caller can drop or resample it (DAPO-style dynamic sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["GroupAdvantages", "group_advantages"]


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages for a flat batch of samples, plus what the normalisation saw.

    ``advantages`` and ``zero_variance`` are per sample (same order as the input);
    ``group_mean`` and ``group_std`` are per sample too (the statistics of its group).
    """

    advantages: npt.NDArray[np.float64]
    zero_variance: npt.NDArray[np.bool_]
    group_mean: npt.NDArray[np.float64]
    group_std: npt.NDArray[np.float64]
    num_groups: int
    num_zero_variance_groups: int


def group_advantages(
    rewards: Sequence[float] | npt.ArrayLike,
    group_ids: Sequence[object] | npt.ArrayLike | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    ddof: int = 1,
    atol: float = 0.0,
) -> GroupAdvantages:
    """Group-normalise ``rewards`` (1-D). ``group_ids`` (same length, any hashable labels)
    says which samples form a group; ``None`` means one group. Groups may differ in size.
    """
    if eps < 0 or atol < 0 or ddof not in (0, 1):
        raise ValueError(f"need eps >= 0, atol >= 0, ddof in (0, 1); got {eps}, {atol}, {ddof}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    if group_ids is None:
        inverse = np.zeros(r.shape[0], dtype=np.intp)
    else:
        ids = np.asarray(group_ids)
        if ids.shape != r.shape:
            raise ValueError(f"group_ids has shape {ids.shape}, rewards {r.shape}")
        _, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(-1)
    num_groups = int(inverse.max()) + 1 if r.size else 0

    count = np.bincount(inverse, minlength=num_groups).astype(np.float64)
    mean = np.bincount(inverse, weights=r, minlength=num_groups) / np.maximum(count, 1.0)
    centred = r - mean[inverse]
    sq = np.bincount(inverse, weights=centred**2, minlength=num_groups)
    std = np.sqrt(sq / np.maximum(count - ddof, 1.0))
    spread = np.zeros(num_groups)
    if r.size:
        g_max = np.full(num_groups, -np.inf)
        g_min = np.full(num_groups, np.inf)
        np.maximum.at(g_max, inverse, r)
        np.minimum.at(g_min, inverse, r)
        spread = g_max - g_min
    zero_var = spread <= atol

    if normalize_std:
        denominator = np.where(zero_var, 1.0, std + eps)  # no 0/0 when eps == 0
        adv = centred / denominator[inverse]
    else:
        adv = centred
    adv = np.where(zero_var[inverse], 0.0, adv)
    return GroupAdvantages(
        advantages=adv,
        zero_variance=zero_var[inverse],
        group_mean=mean[inverse],
        group_std=std[inverse],
        num_groups=num_groups,
        num_zero_variance_groups=int(zero_var.sum()),
    )
