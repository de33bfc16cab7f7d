"""Multi-turn episodes through every loss of the family: environment tokens (tool results
the policy conditioned on) carry exactly zero gradient and count in no denominator.

Each batch mixes policy and environment turns; the reference is the same batch with the
environment tokens cut out of the sequences (what a single-turn trainer would have seen).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from support.synthetic import episode

from consumers.batching import pack
from consumers.loss_config import (
    DecoupledLossConfig,
    GrpoLossConfig,
    MuGrpoLossConfig,
    NavConfig,
    PpoEwmaLossConfig,
)
from consumers.losses import LossInputs, compute_loss
from consumers.metrics import data_metrics, episode_metrics
from consumers.step import step_metrics
from schemas.trajectory import TurnKind

F64 = torch.float64

#: Every loss type, and each of its branches that treats tokens or sequences differently.
CONFIGS: list[Any] = [
    GrpoLossConfig(),
    GrpoLossConfig(aggregation="seq_mean"),
    GrpoLossConfig(aggregation="seq_mean_token_sum", kl_coef=0.1),
    DecoupledLossConfig(),  # MIS, token level, with the catastrophic veto
    DecoupledLossConfig(correction="tis"),
    DecoupledLossConfig(correction="tis", level="geometric", kl_coef=0.05),
    DecoupledLossConfig(correction="mis", level="sequence", aggregation="seq_mean"),
    DecoupledLossConfig(correction="mis", level="geometric", mis_weight="discrepancy"),
    MuGrpoLossConfig(),
    MuGrpoLossConfig(ratio_source="staleness", aggregation="seq_mean"),
    MuGrpoLossConfig(nav=NavConfig(trigger="ratio_above", kappa=1.3)),
    MuGrpoLossConfig(nav=NavConfig(trigger="logp_below", logp_threshold=-1.5)),
    PpoEwmaLossConfig(),
    PpoEwmaLossConfig(correction="tis", level="sequence", kl_coef=0.1),
]


def config_id(config: Any) -> str:
    fields = config.model_dump(exclude_defaults=True)
    return config.type + "".join(f"-{k}={v}" for k, v in sorted(fields.items()) if k != "type")


# Row 0: policy 3 / env 2 / policy 2 / env 1; row 1: policy 2 / env 3 / policy 3;
# row 2: single-turn, 6 tokens (padding after).
TURNS = [[(0, 3), (1, 2), (0, 2), (1, 1)], [(0, 2), (1, 3), (0, 3)], [(0, 6)]]
WIDTH = 8


def layout() -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` masks: every response token, and the policy's tokens."""
    response = torch.zeros(len(TURNS), WIDTH, dtype=torch.bool)
    policy = torch.zeros_like(response)
    for row, turns in enumerate(TURNS):
        start = 0
        for kind, length in turns:
            response[row, start : start + length] = True
            policy[row, start : start + length] = kind == TurnKind.POLICY
            start += length
    return response, policy


def tensors(seed: int) -> dict[str, torch.Tensor]:
    """Log-probs with discrepancies and staleness large enough to clip, mask and veto."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(TURNS), WIDTH)
    infer = -torch.rand(shape, generator=gen, dtype=F64) * 3.0 - 0.05
    old = infer + torch.randn(shape, generator=gen, dtype=F64) * 0.4
    new = old + torch.randn(shape, generator=gen, dtype=F64) * 0.4
    return {
        "logp_new": new,
        "logp_old": old,
        "logp_infer": infer,
        "logp_prox": old + torch.randn(shape, generator=gen, dtype=F64) * 0.1,
        "logp_ref": new + torch.randn(shape, generator=gen, dtype=F64) * 0.2,
        "advantages": torch.tensor([0.8, -1.3, 0.5], dtype=F64),
    }


def inputs_of(values: dict[str, torch.Tensor], mask: torch.Tensor) -> LossInputs:
    new = values["logp_new"].detach().clone().requires_grad_(True)
    return LossInputs(mask=mask, **{**values, "logp_new": new})


def compact(values: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same rows with only the ``keep`` positions, left-aligned (padding 0)."""
    out = {}
    for name, value in values.items():
        if value.dim() == 1:
            out[name] = value.clone()
            continue
        rows = [value[i][keep[i]] for i in range(value.shape[0])]
        width = max(len(r) for r in rows)
        out[name] = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    return out


def compact_mask(keep: torch.Tensor) -> torch.Tensor:
    counts = keep.sum(dim=1)
    return torch.arange(int(counts.max()))[None, :] < counts[:, None]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("seed", range(3))
def test_env_tokens_get_zero_gradient_and_leave_the_loss_unchanged(config: Any, seed: int) -> None:
    response, policy = layout()
    env = response & ~policy
    values = tensors(seed)
    masked = inputs_of(values, policy)
    out = compute_loss(config, masked)
    out.loss.backward()
    assert masked.logp_new.grad is not None
    assert (masked.logp_new.grad[env] == 0).all()  # exactly zero, not small
    if out.metrics.get("train_infer/kept_frac", 1.0) > 0:  # unless MIS dropped every row
        assert masked.logp_new.grad[policy].abs().sum() > 0  # the policy tokens do train

    # The same batch with the environment tokens cut out of the sequences.
    cut = inputs_of(compact(values, policy), compact_mask(policy))
    reference = compute_loss(config, cut)
    reference.loss.backward()
    assert math.isclose(out.loss.item(), reference.loss.item(), rel_tol=1e-12, abs_tol=1e-15)
    assert out.metrics.keys() == reference.metrics.keys()
    for name, value in out.metrics.items():
        assert math.isclose(value, reference.metrics[name], rel_tol=1e-9, abs_tol=1e-12), name
    assert out.metrics["tokens/response"] == float(policy.sum())
    assert cut.logp_new.grad is not None
    torch.testing.assert_close(
        masked.logp_new.grad[policy], cut.logp_new.grad[compact_mask(policy)], rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_anything_at_env_positions_changes_nothing(config: Any) -> None:
    """Perturbed log-probs at env positions (even NaN and -inf) leave loss, metrics and
    gradient bit for bit as they were."""
    response, policy = layout()
    env = response & ~policy
    values = tensors(7)
    baseline = inputs_of(values, policy)
    expected = compute_loss(config, baseline)
    expected.loss.backward()
    for garbage in (float("nan"), float("-inf"), 5.0, -40.0):
        perturbed = {
            k: (torch.where(env, torch.full_like(v, garbage), v) if v.dim() == 2 else v)
            for k, v in values.items()
        }
        inputs = inputs_of(perturbed, policy)
        got = compute_loss(config, inputs)
        got.loss.backward()
        assert got.loss.item() == expected.loss.item(), garbage
        assert got.metrics == expected.metrics, garbage
        assert inputs.logp_new.grad is not None and baseline.logp_new.grad is not None
        assert torch.equal(inputs.logp_new.grad, baseline.logp_new.grad), garbage


# --- from records: pack, step metrics, data metrics --------------------------------------


def test_pack_masks_env_tokens_out_of_the_loss() -> None:
    records = [episode(turns, index=i) for i, turns in enumerate(TURNS)]
    batch = pack(records)
    response, policy = layout()
    assert torch.equal(batch.response_mask, response)
    assert torch.equal(batch.loss_mask, policy)
    metrics = step_metrics({}, batch, None)
    assert metrics["tokens/env"] == float((response & ~policy).sum()) == 6.0
    assert metrics["data/exact_old_frac"] == 1.0


def test_episode_metrics() -> None:
    records = [
        episode(TURNS[0], index=0, end="done", tools=2),
        episode(TURNS[1], index=1, end="tool_timeout", tools=1),
        episode(TURNS[2], index=2),
        episode([(0, 2), (1, 2), (0, 2)], index=3, end="done", tools=1),
    ]
    metrics = episode_metrics(records)
    assert metrics["episode/turns_mean"] == (4 + 3 + 1 + 3) / 4
    assert metrics["episode/turns_max"] == 4.0
    response = 8 + 8 + 6 + 6
    env = 3 + 3 + 0 + 2
    assert math.isclose(metrics["episode/env_token_share"], env / response)
    assert math.isclose(metrics["episode/policy_token_share"], 1 - env / response)
    assert metrics["episode/tool_calls_total"] == 4.0
    assert metrics["episode/tool_calls_mean"] == 1.0
    assert metrics["episode/end/done"] == 2.0 and metrics["episode/end/tool_timeout"] == 1.0
    assert metrics["episode/length_mean"] == 3 + response / 4
    assert metrics["episode/length_max"] == 11.0
    # data_metrics carries them, and token staleness covers policy tokens only
    data = data_metrics(records, version=5)
    assert data["episode/turns_max"] == 4.0 and data["staleness/mean"] == 0.0
