"""The loss family pinned to hand-computed values.

Batches are built from chosen ratios: ``logp_infer = log 0.4`` everywhere, ``logp_old =
logp_infer + log d`` and ``logp_new = logp_old + log s``, so the discrepancy is ``d``, the
staleness ``s`` and the total ratio ``r = d·s``. Arithmetic runs in float64 (the losses keep
float64 inputs in float64), so values are compared tightly.

Standard case, B=2, T=3, A = [+1, -1], PPO clip [0.8, 1.2]:

    ratio  [[1.5, 1.0, 0.5],       seq 0, A=+1: -min(ρA, clip(ρ)A)
            [1.5, 0.5, 1.0]]         1.5 -> -min(1.5, 1.2) = -1.2  (clipped high, no grad)
                                     1.0 -> -1.0
                                     0.5 -> -min(0.5, 0.8) = -0.5
                                   seq 1, A=-1:
                                     1.5 -> -min(-1.5, -1.2) = +1.5
                                     0.5 -> -min(-0.5, -0.8) = +0.8 (clipped low, no grad)
                                     1.0 -> +1.0
    sum = -2.7 + 3.3 = 0.6, token mean = 0.6 / 6 = 0.1
"""

from __future__ import annotations

import math
import tomllib
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError

from consumers.loss_config import (
    DecoupledLossConfig,
    GrpoLossConfig,
    MuGrpoLossConfig,
    NavConfig,
    PpoEwmaLossConfig,
    parse_loss_config,
)
from consumers.losses import (
    LossInputs,
    compute_loss,
    decoupled_loss,
    grpo_loss,
    mu_grpo_loss,
    ppo_ewma_loss,
)

F64 = torch.float64
LOG_P_INFER = math.log(0.4)
S_STD = [[1.5, 1.0, 0.5], [1.5, 0.5, 1.0]]
A_STD = [1.0, -1.0]
LN2 = math.log(2.0)


def k3(x: float) -> float:
    return math.exp(x) - 1.0 - x


def make(
    s: list[list[float]],
    adv: list[float] | list[list[float]],
    d: list[list[float]] | None = None,
    mask: list[list[int]] | None = None,
    **extra: Any,
) -> LossInputs:
    """Inputs with discrepancy ``d`` (default 1) and staleness ``s``; ``logp_new`` is a leaf
    that requires grad."""
    shape = (len(s), len(s[0]))
    infer = torch.full(shape, LOG_P_INFER, dtype=F64)
    old = infer + torch.log(torch.tensor(d, dtype=F64)) if d is not None else infer.clone()
    new = (old + torch.log(torch.tensor(s, dtype=F64))).detach().requires_grad_(True)
    m = torch.ones(shape, dtype=torch.bool) if mask is None else torch.tensor(mask).bool()
    return LossInputs(
        logp_new=new,
        logp_old=old,
        logp_infer=infer,
        advantages=torch.tensor(adv, dtype=F64),
        mask=m,
        **extra,
    )


def grad_of(inputs: LossInputs, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    assert inputs.logp_new.grad is not None
    return inputs.logp_new.grad


def close(actual: float | torch.Tensor, expected: float, tol: float = 1e-9) -> bool:
    value = float(actual.detach()) if isinstance(actual, torch.Tensor) else actual
    return abs(value - expected) <= tol


def grads_close(actual: torch.Tensor, expected: list[list[float]], tol: float = 1e-9) -> bool:
    return torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------
# grpo: plain PPO on the total ratio
# ---------------------------------------------------------------------------------------


def test_grpo_clips_both_sides() -> None:
    inputs = make(S_STD, A_STD)  # d = 1, so r = s
    out = grpo_loss(inputs, GrpoLossConfig())
    assert close(out.loss, 0.1)  # see the module docstring
    assert close(out.metrics["loss/policy"], 0.1)
    assert close(out.metrics["loss/total"], 0.1)
    assert close(out.metrics["clip/frac"], 2 / 6)
    assert close(out.metrics["clip/frac_high"], 1 / 6)  # seq 0 token 0
    assert close(out.metrics["clip/frac_low"], 1 / 6)  # seq 1 token 1
    assert close(out.metrics["ratio/mean"], 6.0 / 6)  # (1.5+1+0.5+1.5+0.5+1)/6
    assert close(out.metrics["ratio/max"], 1.5)
    assert out.metrics["tokens/response"] == 6.0


def test_grpo_clipped_tokens_get_zero_gradient() -> None:
    inputs = make(S_STD, A_STD)
    out = grpo_loss(inputs, GrpoLossConfig())
    # d/dlogp of -(ρ·A)/6 is -ρ·A/6 where unclipped, 0 where the clip is active.
    expected = [[0.0, -1.0 / 6, -0.5 / 6], [1.5 / 6, 0.0, 1.0 / 6]]
    assert grads_close(grad_of(inputs, out.loss), expected)


def test_grpo_eps_low_and_eps_high_are_separate() -> None:
    # eps_low = 0.6: lower bound 0.4, seq 1 token 1 (ρ=0.5, A=-1) is no longer clipped:
    # +0.5 instead of +0.8 -> (0.6 - 0.3) / 6 = 0.05.
    out = grpo_loss(make(S_STD, A_STD), GrpoLossConfig(eps_low=0.6))
    assert close(out.loss, 0.3 / 6)
    assert close(out.metrics["clip/frac_low"], 0.0)
    assert close(out.metrics["clip/frac_high"], 1 / 6)
    # eps_high = 0.4: upper bound 1.4, seq 0 token 0 gives -1.4 instead of -1.2:
    # (0.6 - 0.2) / 6.
    out = grpo_loss(make(S_STD, A_STD), GrpoLossConfig(eps_high=0.4))
    assert close(out.loss, 0.4 / 6)
    assert close(out.metrics["clip/frac_low"], 1 / 6)


def test_per_token_advantages() -> None:
    # A = [[2, 0, 0], [0, 0, -1]]: seq 0 token 0: ρ=1.5, -min(3.0, 1.2*2) = -2.4;
    # seq 1 token 2: ρ=1.0, A=-1 -> +1.0; the rest have A=0 -> 0. (-2.4 + 1.0) / 6.
    inputs = make(S_STD, [[2.0, 0.0, 0.0], [0.0, 0.0, -1.0]])
    out = grpo_loss(inputs, GrpoLossConfig())
    assert close(out.loss, -1.4 / 6)
    # clipped token -> 0; seq 1 token 2: -ρA/6 = 1/6.
    assert grads_close(grad_of(inputs, out.loss), [[0, 0, 0], [0, 0, 1 / 6]])


# ---------------------------------------------------------------------------------------
# aggregation and masking
# ---------------------------------------------------------------------------------------

MASK_PAD = [[1, 1, 0], [1, 1, 1]]  # seq 0 token 2 is padding


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # mask [[1, 1, 1], [1, 1, 0]]: seq 0 [-1.2, -1.0, -0.5], seq 1 [+1.5, +0.8]
        ("token_mean", (-2.7 + 2.3) / 5),  # -0.08
        ("seq_mean", (-2.7 / 3 + 2.3 / 2) / 2),  # (-0.9 + 1.15) / 2 = 0.125
        ("seq_mean_token_sum", (-2.7 + 2.3) / 2),  # -0.2
    ],
)
def test_aggregation(aggregation: str, expected: float) -> None:
    inputs = make(S_STD, A_STD, mask=[[1, 1, 1], [1, 1, 0]])
    out = grpo_loss(inputs, GrpoLossConfig(aggregation=aggregation))  # type: ignore[arg-type]
    assert close(out.loss, expected)


def test_seq_mean_gradient_scales_per_sequence() -> None:
    inputs = make(S_STD, A_STD, mask=MASK_PAD)
    out = grpo_loss(inputs, GrpoLossConfig(aggregation="seq_mean"))
    # seq 0 has 2 tokens, seq 1 has 3, 2 sequences: grad = -ρA / (len · 2).
    expected = [[0.0, -1.0 / 4, 0.0], [1.5 / 6, 0.0, 1.0 / 6]]
    assert grads_close(grad_of(inputs, out.loss), expected)


def test_padding_garbage_does_not_leak() -> None:
    inputs = make(S_STD, A_STD, mask=MASK_PAD)
    with torch.no_grad():
        inputs.logp_new[0, 2] = float("nan")
        inputs.logp_infer[0, 2] = float("-inf")
    out = grpo_loss(inputs, GrpoLossConfig())
    assert close(out.loss, 1.1 / 5)
    grad = grad_of(inputs, out.loss)
    assert torch.isfinite(grad).all()
    assert grad[0, 2] == 0.0  # the masked token gets exactly zero gradient


# ---------------------------------------------------------------------------------------
# decoupled: TIS / MIS on d, PPO on s
# ---------------------------------------------------------------------------------------
# The per-token surrogate on s (S_STD, A_STD, clip [0.8, 1.2]) before weights and masks:
#   seq 0: [-1.2 (clipped), -1.0, -0.5]    seq 1: [+1.5, +0.8 (clipped), +1.0]


def test_tis_token_truncates_weight() -> None:
    d = [[1.0, 3.0, 0.5], [1.0, 1.0, 1.0]]
    inputs = make(S_STD, A_STD, d=d)
    cfg = DecoupledLossConfig(correction="tis", level="token", token_bounds=(0.5, 2.0))
    out = decoupled_loss(inputs, cfg)
    # weights min(d, 2) = [[1, 2, 0.5], [1, 1, 1]]
    # seq 0: -1.2*1 + -1.0*2 + -0.5*0.5 = -3.45 ; seq 1: +3.3 -> -0.15 / 6
    assert close(out.loss, -0.15 / 6)
    assert close(out.metrics["tis/truncated_frac"], 1 / 6)
    assert close(out.metrics["tis/weight_mean"], 6.5 / 6)
    assert close(out.metrics["train_infer/kept_frac"], 1.0)
    assert close(out.metrics["discrepancy/mean"], 7.5 / 6)
    # gradient -w·s·A/6: seq 0 token 1: -2*1*1/6; token 2: -0.5*0.5/6
    expected = [[0.0, -2.0 / 6, -0.25 / 6], [1.5 / 6, 0.0, 1.0 / 6]]
    assert grads_close(grad_of(inputs, out.loss), expected)


def test_tis_weight_carries_no_gradient_to_logp_old() -> None:
    inputs = make(S_STD, A_STD, d=[[1.0, 3.0, 0.5], [1.0, 1.0, 1.0]])
    assert inputs.logp_old is not None
    inputs.logp_old.requires_grad_(True)
    out = decoupled_loss(inputs, DecoupledLossConfig(correction="tis"))
    out.loss.backward()
    assert inputs.logp_old.grad is None


def test_mis_token_masks_outside_interval() -> None:
    d = [[1.0, 3.0, 0.25], [1.0, 0.6, 1.0]]  # 3.0 and 0.25 leave [0.5, 2]
    inputs = make(S_STD, A_STD, d=d)
    out = decoupled_loss(inputs, DecoupledLossConfig(correction="mis", level="token"))
    # kept: seq 0 token 0 (-1.2), seq 1 (+1.5 +0.8 +1.0) -> 2.1 / 6 (denominator: 6 tokens)
    assert close(out.loss, 2.1 / 6)
    assert close(out.metrics["mis/masked_frac"], 2 / 6)
    assert close(out.metrics["train_infer/kept_frac"], 4 / 6)
    assert "mis/masked_seqs" not in out.metrics
    # masked tokens get zero gradient; the others keep -s·A/6 (no renormalisation)
    expected = [[0.0, 0.0, 0.0], [1.5 / 6, 0.0, 1.0 / 6]]
    assert grads_close(grad_of(inputs, out.loss), expected)


def test_mis_interval_is_inclusive() -> None:
    # d = 1 exactly (log d = 0) at every token; bounds [1, 2] keep them all.
    out = decoupled_loss(make(S_STD, A_STD), DecoupledLossConfig(token_bounds=(1.0, 2.0)))
    assert close(out.metrics["mis/masked_frac"], 0.0)
    assert close(out.loss, 0.1)


def test_mis_sequence_level_uses_product() -> None:
    d = [[1.8, 1.8, 1.5], [0.6, 1.0, 1.5]]  # products 4.86 (out of [0.5, 2]) and 0.9 (in)
    inputs = make(S_STD, A_STD, d=d)
    out = decoupled_loss(inputs, DecoupledLossConfig(level="sequence"))
    assert close(out.loss, 3.3 / 6)  # only seq 1: (1.5 + 0.8 + 1.0) / 6
    assert close(out.metrics["mis/masked_frac"], 0.5)
    assert out.metrics["mis/masked_seqs"] == 1.0
    # with token level nothing is masked: every d is within [0.5, 2]
    out = decoupled_loss(make(S_STD, A_STD, d=d), DecoupledLossConfig(level="token"))
    assert close(out.loss, 0.1)


def test_sequence_product_ignores_padding() -> None:
    # seq 1 token 2 is padding with d = 100; the product over response tokens is 0.6*1 = 0.6
    # (kept by [0.5, 2]); with the padding it would be 60 (masked).
    d = [[1.0, 1.0, 1.0], [0.6, 1.0, 100.0]]
    out = decoupled_loss(
        make(S_STD, A_STD, d=d, mask=[[1, 1, 1], [1, 1, 0]]),
        DecoupledLossConfig(level="sequence"),
    )
    assert close(out.metrics["mis/masked_frac"], 0.0)
    assert close(out.loss, (-2.7 + 1.5 + 0.8) / 5)


def test_geometric_level_uses_tight_bounds_on_the_geometric_mean() -> None:
    d = [[1.001, 1.001, 1.0], [0.5, 1.0, 1.5]]
    # geometric means: seq 0 (1.001^2)^(1/3) = 1.000667 inside [1/1.002, 1.002];
    #                  seq 1 0.75^(1/3) = 0.9086 outside -> masked.
    out = decoupled_loss(make(S_STD, A_STD, d=d), DecoupledLossConfig(level="geometric"))
    assert close(out.loss, -2.7 / 6)  # seq 0 only: -1.2 - 1.0 - 0.5
    assert out.metrics["mis/masked_seqs"] == 1.0
    # sequence level with [0.5, 2]: products 1.002001 and 0.75, both kept.
    out = decoupled_loss(make(S_STD, A_STD, d=d), DecoupledLossConfig(level="sequence"))
    assert close(out.loss, 0.6 / 6)


def test_tis_geometric_weights_whole_sequences() -> None:
    d = [[1.001, 1.001, 1.0], [0.5, 1.0, 1.5]]
    g0, g1 = 1.002001 ** (1 / 3), 0.75 ** (1 / 3)  # both below the cap 1.002
    cfg = DecoupledLossConfig(correction="tis", level="geometric")
    out = decoupled_loss(make(S_STD, A_STD, d=d), cfg)
    assert close(out.loss, (-2.7 * g0 + 3.3 * g1) / 6)
    assert close(out.metrics["tis/truncated_frac"], 0.0)
    # cap 1.0005 truncates seq 0's weight to 1.0005 (3 tokens truncated)
    cfg = DecoupledLossConfig(correction="tis", level="geometric", geometric_bounds=(0.5, 1.0005))
    out = decoupled_loss(make(S_STD, A_STD, d=d), cfg)
    assert close(out.loss, (-2.7 * 1.0005 + 3.3 * g1) / 6)
    assert close(out.metrics["tis/truncated_frac"], 0.5)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_catastrophic_veto_drops_whole_sequence(correction: str) -> None:
    d = [[1.0, 1.0, 5e-5], [1.0, 1.0, 1.0]]  # one token of seq 0 has d < 1e-4
    cfg = DecoupledLossConfig(correction=correction)  # type: ignore[arg-type]
    inputs = make(S_STD, A_STD, d=d)
    out = decoupled_loss(inputs, cfg)
    assert close(out.loss, 3.3 / 6)  # seq 1 only
    assert out.metrics["veto/catastrophic_seqs"] == 1.0
    assert close(out.metrics["train_infer/kept_frac"], 0.5)
    grad = grad_of(inputs, out.loss)
    assert (grad[0] == 0).all() and (grad[1] != 0).sum() == 2  # seq 1 token 1 is clipped


def test_catastrophic_veto_threshold_is_configurable() -> None:
    d = [[1.0, 1.0, 5e-5], [1.0, 1.0, 1.0]]
    # TIS keeps the token with weight 5e-5: seq 0 = -1.2 - 1.0 - 0.5*5e-5
    expected = (-2.2 - 0.5 * 5e-5 + 3.3) / 6
    for threshold in (None, 1e-5):
        cfg = DecoupledLossConfig(correction="tis", catastrophic_threshold=threshold)
        out = decoupled_loss(make(S_STD, A_STD, d=d), cfg)
        assert out.metrics["veto/catastrophic_seqs"] == 0.0
        assert close(out.loss, expected)


def test_catastrophic_veto_ignores_padding() -> None:
    d = [[1.0, 1.0, 5e-5], [1.0, 1.0, 1.0]]
    out = decoupled_loss(make(S_STD, A_STD, d=d, mask=MASK_PAD), DecoupledLossConfig())
    assert out.metrics["veto/catastrophic_seqs"] == 0.0
    assert close(out.loss, (-2.2 + 3.3) / 5)


def test_staleness_clip_has_its_own_eps() -> None:
    # staleness_eps_low = 0.6: seq 1 token 1 (s = 0.5) is unclipped: +0.5 instead of +0.8
    cfg = DecoupledLossConfig(staleness_eps_low=0.6)
    out = decoupled_loss(make(S_STD, A_STD), cfg)
    assert close(out.loss, 0.3 / 6)
    assert close(out.metrics["clip/frac"], 1 / 6)
    # staleness_eps_high = 0.4: seq 0 token 0 gives -1.4 -> (0.6 - 0.2) / 6
    out = decoupled_loss(make(S_STD, A_STD), DecoupledLossConfig(staleness_eps_high=0.4))
    assert close(out.loss, 0.4 / 6)


def test_clip_acts_on_staleness_not_total_ratio() -> None:
    # d = 1.5 (kept by MIS [0.5, 2]), s = 1.0, A = +1: r = 1.5 is outside [0.8, 1.2] but s is
    # not. grpo (on r) clips: -1.2 per token; decoupled (on s) does not: -1.0 per token.
    s, d, adv = [[1.0, 1.0]], [[1.5, 1.5]], [1.0]
    assert close(decoupled_loss(make(s, adv, d=d), DecoupledLossConfig()).loss, -1.0)
    assert close(grpo_loss(make(s, adv, d=d), GrpoLossConfig()).loss, -1.2)


@pytest.mark.parametrize("seed", range(4))
def test_total_ratio_factors_as_d_times_s(seed: int) -> None:
    """r = d·s: with every correction and clip disabled, the decoupled loss on (d, s)
    must equal the unclipped GRPO loss on r, in value and gradient."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 5
    infer = -torch.rand(b, t, generator=g, dtype=F64) * 3
    old = infer + torch.randn(b, t, generator=g, dtype=F64) * 0.5
    new_value = old + torch.randn(b, t, generator=g, dtype=F64) * 0.5
    adv = torch.randn(b, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.3

    def run(fn: Any, cfg: Any) -> tuple[float, torch.Tensor]:
        new = new_value.clone().requires_grad_(True)
        inputs = LossInputs(logp_new=new, logp_old=old, logp_infer=infer, advantages=adv, mask=mask)
        out = fn(inputs, cfg)
        out.loss.backward()
        return out.loss.item(), new.grad

    inf = float("inf")
    loss_r, grad_r = run(grpo_loss, GrpoLossConfig(eps_low=1.0, eps_high=inf, dual_clip=None))
    loss_ds, grad_ds = run(
        decoupled_loss,
        DecoupledLossConfig(
            correction="tis",
            token_bounds=(0.0, inf),
            catastrophic_threshold=None,
            staleness_eps_low=1.0,
            staleness_eps_high=inf,
            dual_clip=None,
        ),
    )
    # direct: -mean over response tokens of exp(new - infer) * A
    r = torch.exp(new_value - infer)
    direct = -(r * adv[:, None])[mask].sum() / mask.sum().clamp(min=1)
    assert math.isclose(loss_r, float(direct), rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(loss_ds, loss_r, rel_tol=1e-12, abs_tol=1e-12)
    assert torch.allclose(grad_ds, grad_r, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------
# mu_grpo: relaxed clipping and the negative-advantage veto
# ---------------------------------------------------------------------------------------


def test_mu_grpo_relaxed_clip() -> None:
    s = [[1.5, 6.0, 0.5], [1.5, 6.0, 0.5]]
    out = mu_grpo_loss(make(s, A_STD), MuGrpoLossConfig(nav=None))  # clip [0, 5]
    # seq 0, A=+1: -1.5 (unclipped, grpo would clip at 1.2), -5.0 (clipped), -0.5
    # seq 1, A=-1: +1.5, +6.0 (A<0 with ρ > hi is not clipped), +0.5 -> (-7 + 8) / 6
    assert close(out.loss, 1.0 / 6)
    assert close(out.metrics["clip/frac"], 1 / 6)
    assert close(out.metrics["clip/frac_high"], 1 / 6)
    # the same ratios under grpo [0.8, 1.2]: -1.2 -1.2 -0.5 +1.5 +6.0 +0.8 -> 5.4 / 6
    assert close(grpo_loss(make(s, A_STD), GrpoLossConfig(dual_clip=None)).loss, 5.4 / 6)
    # and with grpo's default dual clip, 6.0 with A < 0 is capped at 3.0 -> 2.4 / 6
    assert close(grpo_loss(make(s, A_STD), GrpoLossConfig()).loss, 2.4 / 6)


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [(grpo_loss, GrpoLossConfig()), (decoupled_loss, DecoupledLossConfig())],
    ids=["grpo", "decoupled"],
)
def test_dual_clip_caps_a_negative_advantage_token_whose_ratio_spiked(
    loss_fn: Any, config: Any
) -> None:
    # A = -1: the ratio 1000 (a token 1000x likelier than when sampled) would add +1000;
    # the dual clip c = 3 caps it at +3 with no gradient. Ratios 2.5 (< c) and 1.0 keep
    # the plain surrogate and its gradient; the A = +1 row is untouched (ratio 1000 is
    # clipped high there as before).
    s = [[1000.0, 2.5, 1.0], [1000.0, 1.0, 1.0]]
    capped = make(s, [-1.0, 1.0])
    out = loss_fn(capped, config)
    assert close(out.loss, (3.0 + 2.5 + 1.0 - 1.2 - 1.0 - 1.0) / 6)
    assert close(out.metrics["clip/frac_dual"], 1 / 6)
    assert close(out.metrics["clip/frac"], 2 / 6)  # the dual cut and row 1's high clip
    assert grads_close(grad_of(capped, out.loss), [[0.0, 2.5 / 6, 1.0 / 6], [0.0, -1 / 6, -1 / 6]])
    plain = make(s, [-1.0, 1.0])
    out = loss_fn(plain, config.model_copy(update={"dual_clip": None}))
    assert close(out.loss, (1000.0 + 2.5 + 1.0 - 1.2 - 1.0 - 1.0) / 6)
    assert close(out.metrics["clip/frac_dual"], 0.0)
    assert grad_of(plain, out.loss)[0, 0] == pytest.approx(1000.0 / 6)


def test_dual_clip_is_on_by_default_except_for_mu_grpo() -> None:
    assert GrpoLossConfig().dual_clip == 3.0
    assert DecoupledLossConfig().dual_clip == 3.0
    assert PpoEwmaLossConfig().dual_clip == 3.0
    assert MuGrpoLossConfig().dual_clip is None  # NAV bounds negative advantages there
    out = mu_grpo_loss(make([[6.0]], [-1.0]), MuGrpoLossConfig(nav=None, dual_clip=4.0))
    assert close(out.loss, 4.0)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, float("nan"), "three", [3.0]])
def test_dual_clip_garbage_is_refused(bad: Any) -> None:
    with pytest.raises(ValidationError, match="dual_clip"):
        parse_loss_config({"type": "decoupled", "dual_clip": bad})
    unbounded = parse_loss_config({"type": "grpo", "dual_clip": float("inf")})  # TOML's "off"
    assert unbounded.dual_clip is None
    assert parse_loss_config({"type": "mu_grpo", "dual_clip": float("inf")}).dual_clip is None
    s = [[1000.0, 1.0], [1.0, 1.0]]
    out = grpo_loss(make(s, [-1.0, 0.0]), unbounded)
    assert close(out.loss, 1001.0 / 4) and close(out.metrics["clip/frac_dual"], 0.0)


NAV_R = [[1.0, 3.0, 1.5, 0.5], [1.0, 3.0, 1.5, 0.5]]  # first ratio > 2 at token 1


def test_nav_drops_suffix_after_trigger_for_negative_advantage() -> None:
    inputs = make(NAV_R, A_STD)
    out = mu_grpo_loss(inputs, MuGrpoLossConfig(nav=NavConfig(kappa=2.0)))
    # seq 0 (A=+1), nothing vetoed: -(1 + 3 + 1.5 + 0.5) = -6
    # seq 1 (A=-1), trigger = token 1 (3.0 > 2), kept; tokens 2, 3 vetoed: +1 +3
    # (-6 + 4) / 8
    assert close(out.loss, -2.0 / 8)
    assert close(out.metrics["nav/vetoed_frac"], 2 / 8)
    assert out.metrics["nav/vetoed_seqs"] == 1.0
    expected = [
        [-1.0 / 8, -3.0 / 8, -1.5 / 8, -0.5 / 8],
        [1.0 / 8, 3.0 / 8, 0.0, 0.0],  # trigger token keeps its gradient
    ]
    assert grads_close(grad_of(inputs, out.loss), expected)


def test_nav_include_trigger_drops_the_trigger_too() -> None:
    inputs = make(NAV_R, A_STD)
    out = mu_grpo_loss(inputs, MuGrpoLossConfig(nav=NavConfig(kappa=2.0, include_trigger=True)))
    assert close(out.loss, (-6.0 + 1.0) / 8)
    assert close(out.metrics["nav/vetoed_frac"], 3 / 8)
    assert grads_close(grad_of(inputs, out.loss)[1:], [[1.0 / 8, 0.0, 0.0, 0.0]])


def test_nav_only_the_first_trigger_counts_and_threshold_is_strict() -> None:
    # seq 1 ratios [0.5, 1.9, 2.5, 0.5, 3.0]: the first trigger is token 2; tokens 3 and 4
    # are vetoed even though token 4 is a trigger too.
    r = [[1.0, 1.0, 1.0, 1.0, 1.0], [0.5, 1.9, 2.5, 0.5, 3.0]]
    out = mu_grpo_loss(make(r, A_STD), MuGrpoLossConfig(nav=NavConfig(kappa=2.0)))
    # seq 0: -5; seq 1 kept: +0.5 +1.9 +2.5 -> (-5 + 4.9) / 10
    assert close(out.loss, -0.1 / 10)
    assert close(out.metrics["nav/vetoed_frac"], 2 / 10)
    # strict: ratios exactly 1.0 (log-ratio 0) with kappa = 1 trigger nothing
    flat = mu_grpo_loss(make([[1.0] * 3], [-1.0]), MuGrpoLossConfig(nav=NavConfig(kappa=1.0)))
    assert flat.metrics["nav/vetoed_frac"] == 0.0


def test_nav_no_trigger_changes_nothing() -> None:
    off = mu_grpo_loss(make(NAV_R, A_STD), MuGrpoLossConfig(nav=None))
    high = mu_grpo_loss(make(NAV_R, A_STD), MuGrpoLossConfig(nav=NavConfig(kappa=10.0)))
    assert close(off.loss, (-6.0 + 6.0) / 8)
    assert close(high.loss, off.loss.item())
    assert high.metrics["nav/vetoed_frac"] == 0.0


def test_nav_per_token_advantages_veto_only_negative_tokens() -> None:
    adv = [[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, -1.0]]
    out = mu_grpo_loss(make(NAV_R, adv), MuGrpoLossConfig())
    # seq 1: trigger at token 1; suffix = tokens 2 (A=+1, kept: -1.5) and 3 (A=-1, vetoed)
    # seq 0: -6; seq 1: +1 +3 -1.5 -> (-6 + 2.5) / 8
    assert close(out.loss, -3.5 / 8)
    assert close(out.metrics["nav/vetoed_frac"], 1 / 8)


def test_nav_trigger_ignores_padding() -> None:
    # seq 1 token 0 is masked (prompt side) with ratio 3.0: it must not trigger.
    r = [[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]]
    out = mu_grpo_loss(make(r, A_STD, mask=[[1, 1, 1], [0, 1, 1]]), MuGrpoLossConfig())
    assert out.metrics["nav/vetoed_frac"] == 0.0
    assert close(out.loss, (-3.0 + 2.0) / 5)


def test_nav_logp_below_trigger() -> None:
    # all ratios 1; seq 1 token 2 was sampled with p = 1e-5 < 1e-4 -> trigger; token 3 vetoed.
    inputs = make([[1.0] * 4, [1.0] * 4], A_STD)
    with torch.no_grad():
        for t in (inputs.logp_new, inputs.logp_old, inputs.logp_infer):
            assert t is not None
            t[1, 2] = math.log(1e-5)
    cfg = MuGrpoLossConfig(nav=NavConfig(trigger="logp_below", logp_threshold=math.log(1e-4)))
    out = mu_grpo_loss(inputs, cfg)
    assert close(out.loss, (-4.0 + 3.0) / 8)
    assert close(out.metrics["nav/vetoed_frac"], 1 / 8)


def test_mu_grpo_staleness_ratio_source() -> None:
    # d = 4, s = 1, A = -1: the total ratio 4 > kappa triggers at token 0 (tokens 1, 2
    # vetoed); the staleness ratio 1 does not.
    s, d, adv = [[1.0, 1.0, 1.0]], [[4.0, 4.0, 4.0]], [-1.0]
    total = mu_grpo_loss(make(s, adv, d=d), MuGrpoLossConfig())
    assert close(total.metrics["nav/vetoed_frac"], 2 / 3)
    assert close(total.loss, 4.0 / 3)  # only the trigger token: -min(-4, -4) = +4
    stale = mu_grpo_loss(make(s, adv, d=d), MuGrpoLossConfig(ratio_source="staleness"))
    assert stale.metrics["nav/vetoed_frac"] == 0.0
    assert close(stale.loss, 1.0)  # +1 +1 +1 over 3 tokens
    inputs = make(s, adv, d=d)
    no_old = LossInputs(
        logp_new=inputs.logp_new,
        logp_infer=inputs.logp_infer,
        advantages=inputs.advantages,
        mask=inputs.mask,
    )
    with pytest.raises(ValueError, match="logp_old"):
        mu_grpo_loss(no_old, MuGrpoLossConfig(ratio_source="staleness"))


# ---------------------------------------------------------------------------------------
# ppo_ewma
# ---------------------------------------------------------------------------------------


def test_ppo_ewma_is_decoupled_anchored_on_logp_prox() -> None:
    d = [[1.0, 3.0, 0.25], [1.0, 0.6, 1.0]]
    ref = make(S_STD, A_STD, d=d)
    assert ref.logp_old is not None
    # logp_old is deliberately wrong: ppo_ewma must use logp_prox only.
    inputs = LossInputs(
        logp_new=ref.logp_new.detach().clone().requires_grad_(True),
        logp_old=ref.logp_old - 5.0,
        logp_infer=ref.logp_infer,
        logp_prox=ref.logp_old,
        advantages=ref.advantages,
        mask=ref.mask,
    )
    out = ppo_ewma_loss(inputs, PpoEwmaLossConfig())
    base = decoupled_loss(ref, DecoupledLossConfig())
    assert close(out.loss, 2.1 / 6)  # as in test_mis_token_masks_outside_interval
    assert close(out.loss, base.loss.item())
    assert torch.equal(grad_of(inputs, out.loss), grad_of(ref, base.loss))
    assert close(out.metrics["train_infer/kept_frac"], 4 / 6)
    # prox/k3_kl: mean k3(log d_prox); mismatch/k3_kl uses the (wrong) logp_old: log d - 5
    logs = [math.log(x) for row in d for x in row]
    assert close(out.metrics["prox/k3_kl"], sum(k3(x) for x in logs) / 6)
    assert close(out.metrics["mismatch/k3_kl"], sum(k3(x - 5.0) for x in logs) / 6)


def test_missing_anchor_is_an_error() -> None:
    inputs = make(S_STD, A_STD)
    with pytest.raises(ValueError, match="logp_prox"):
        ppo_ewma_loss(inputs, PpoEwmaLossConfig())
    no_old = LossInputs(
        logp_new=inputs.logp_new,
        logp_infer=inputs.logp_infer,
        advantages=inputs.advantages,
        mask=inputs.mask,
    )
    with pytest.raises(ValueError, match="logp_old"):
        decoupled_loss(no_old, DecoupledLossConfig())


# ---------------------------------------------------------------------------------------
# KL terms and metrics
# ---------------------------------------------------------------------------------------


def test_mismatch_k3_direction() -> None:
    # x = logp_old - logp_infer = log d; d = 2 at one token, 1 elsewhere:
    # k3(ln 2) = 2 - 1 - ln 2 = 0.306853 (the other direction would give 0.193147).
    d = [[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    out = grpo_loss(make(S_STD, A_STD, d=d), GrpoLossConfig())
    assert close(out.metrics["mismatch/k3_kl"], (1.0 - LN2) / 6)
    # with logp_old missing the metric is absent
    inputs = make(S_STD, A_STD)
    no_old = LossInputs(
        logp_new=inputs.logp_new,
        logp_infer=inputs.logp_infer,
        advantages=inputs.advantages,
        mask=inputs.mask,
    )
    assert "mismatch/k3_kl" not in grpo_loss(no_old, GrpoLossConfig()).metrics


def test_kl_to_reference_value_and_gradient() -> None:
    # A = 0 so the policy term is 0. logp_ref = logp_new - ln 2 everywhere:
    # x = logp_ref - logp_new = -ln 2, k3 = 0.5 - 1 + ln 2 = 0.193147 per token.
    # d k3 / d logp_new = 1 - exp(x) = 0.5; token mean over 6 -> 0.1 * 0.5 / 6 per token.
    base = make(S_STD, [0.0, 0.0])
    inputs = LossInputs(
        logp_new=base.logp_new,
        logp_old=base.logp_old,
        logp_infer=base.logp_infer,
        advantages=base.advantages,
        mask=base.mask,
        logp_ref=base.logp_new.detach() - LN2,
    )
    out = grpo_loss(inputs, GrpoLossConfig(kl_coef=0.1))
    kl = 0.5 - 1.0 + LN2
    assert close(out.metrics["kl/ref_k3"], kl)
    assert close(out.metrics["loss/kl"], 0.1 * kl)
    assert close(out.loss, 0.1 * kl)
    assert close(out.metrics["loss/policy"], 0.0)
    assert grads_close(grad_of(inputs, out.loss), [[0.1 * 0.5 / 6] * 3] * 2)


def test_kl_reported_without_penalty_and_required_with_it() -> None:
    base = make(S_STD, A_STD)
    with_ref = LossInputs(
        logp_new=base.logp_new,
        logp_old=base.logp_old,
        logp_infer=base.logp_infer,
        advantages=base.advantages,
        mask=base.mask,
        logp_ref=base.logp_new.detach() - LN2,
    )
    out = grpo_loss(with_ref, GrpoLossConfig())  # kl_coef = 0
    assert close(out.loss, 0.1)
    assert close(out.metrics["kl/ref_k3"], 0.5 - 1.0 + LN2)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(base, GrpoLossConfig(kl_coef=0.1))


ALL_CONFIGS = [
    GrpoLossConfig(),
    DecoupledLossConfig(),
    DecoupledLossConfig(correction="tis", level="geometric"),
    DecoupledLossConfig(level="sequence", aggregation="seq_mean"),
    MuGrpoLossConfig(aggregation="seq_mean_token_sum"),
    PpoEwmaLossConfig(),
]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.type}")
def test_empty_mask_gives_finite_zero_loss(config: Any) -> None:
    base = make(S_STD, A_STD, mask=[[0, 0, 0], [0, 0, 0]])
    with torch.no_grad():
        base.logp_new[0, 0] = float("nan")
    inputs = LossInputs(
        logp_new=base.logp_new,
        logp_old=base.logp_old,
        logp_infer=base.logp_infer,
        advantages=base.advantages,
        mask=base.mask,
        logp_prox=base.logp_old,
        logp_ref=base.logp_infer,
    )
    out = compute_loss(config, inputs)
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
    grad = grad_of(inputs, out.loss)
    assert (grad == 0).all()
    if "train_infer/kept_frac" in out.metrics:
        assert out.metrics["train_infer/kept_frac"] == 1.0


def test_seq_mean_skips_empty_sequences() -> None:
    # seq 0 empty: seq_mean is seq 1's mean alone (3.3 / 3), not halved.
    out = grpo_loss(
        make(S_STD, A_STD, mask=[[0, 0, 0], [1, 1, 1]]), GrpoLossConfig(aggregation="seq_mean")
    )
    assert close(out.loss, 1.1)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"{c.type}")
def test_compute_loss_dispatches(config: Any) -> None:
    base = make(S_STD, A_STD, d=[[1.0, 1.5, 0.7], [1.0, 1.0, 0.9]])
    inputs = LossInputs(
        logp_new=base.logp_new,
        logp_old=base.logp_old,
        logp_infer=base.logp_infer,
        advantages=base.advantages,
        mask=base.mask,
        logp_prox=base.logp_old,
    )
    direct = {
        "grpo": grpo_loss,
        "decoupled": decoupled_loss,
        "mu_grpo": mu_grpo_loss,
        "ppo_ewma": ppo_ewma_loss,
    }[config.type](inputs, config)
    out = compute_loss(config, inputs)
    assert out.loss.item() == direct.loss.item()
    assert out.metrics == direct.metrics


def test_bf16_inputs_are_computed_in_float32() -> None:
    base = make(S_STD, A_STD)
    new = base.logp_new.detach().to(torch.bfloat16).requires_grad_(True)
    inputs = LossInputs(
        logp_new=new,
        logp_infer=base.logp_infer.to(torch.bfloat16),
        advantages=base.advantages.to(torch.bfloat16),
        mask=base.mask.float(),  # a 0/1 float mask works too
    )
    out = grpo_loss(inputs, GrpoLossConfig())
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - 0.1) < 2e-2  # bf16 log-probs carry ~3 significant digits
    out.loss.backward()
    assert new.grad is not None and new.grad.dtype == torch.bfloat16


def test_input_shapes_are_checked() -> None:
    base = make(S_STD, A_STD)
    with pytest.raises(ValueError, match="logp_infer"):
        LossInputs(
            logp_new=base.logp_new,
            logp_infer=base.logp_infer[:, :2],
            advantages=base.advantages,
            mask=base.mask,
        )
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(
            logp_new=base.logp_new,
            logp_infer=base.logp_infer,
            advantages=torch.zeros(3),
            mask=base.mask,
        )


# ---------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------


def test_config_union_is_chosen_by_type() -> None:
    assert isinstance(parse_loss_config({"type": "grpo"}), GrpoLossConfig)
    assert isinstance(parse_loss_config({"type": "decoupled"}), DecoupledLossConfig)
    assert isinstance(parse_loss_config({"type": "ppo_ewma"}), PpoEwmaLossConfig)
    mu = parse_loss_config({"type": "mu_grpo", "nav": {"trigger": "logp_below"}})
    assert isinstance(mu, MuGrpoLossConfig) and mu.nav is not None
    assert mu.nav.trigger == "logp_below"
    with pytest.raises(ValidationError):
        parse_loss_config({"type": "nope"})
    with pytest.raises(ValidationError):
        parse_loss_config({"type": "grpo", "eps": 0.2})  # unknown key
    with pytest.raises(ValidationError):
        parse_loss_config({"type": "grpo", "staleness_eps_low": 0.2})  # other variant's key


def test_config_from_toml() -> None:
    data = tomllib.loads(
        """
        type = "decoupled"
        correction = "mis"
        level = "geometric"
        geometric_bounds = [0.997, 1.003]
        catastrophic_threshold = 1e-4
        staleness_eps_low = 0.2
        staleness_eps_high = 0.28
        aggregation = "seq_mean"
        """
    )
    cfg = parse_loss_config(data)
    assert isinstance(cfg, DecoupledLossConfig)
    assert cfg.bounds() == (0.997, 1.003)
    assert cfg.staleness_eps_high == 0.28


def test_config_validation() -> None:
    with pytest.raises(ValidationError):
        DecoupledLossConfig(token_bounds=(1.5, 2.0))  # low > 1 would mask d = 1
    with pytest.raises(ValidationError):
        DecoupledLossConfig(token_bounds=(1.0, 1.0))  # empty interval
    with pytest.raises(ValidationError):
        MuGrpoLossConfig(clip_bounds=(0.0, 0.9))
    with pytest.raises(ValidationError):
        PpoEwmaLossConfig(beta=1.0)
    with pytest.raises(ValidationError):
        GrpoLossConfig(eps_low=1.5)
    cfg = GrpoLossConfig()
    with pytest.raises(ValidationError):
        cfg.eps_low = 0.1  # type: ignore[misc]  # frozen


def _all_models() -> list[type[BaseModel]]:
    return [GrpoLossConfig, DecoupledLossConfig, MuGrpoLossConfig, PpoEwmaLossConfig, NavConfig]


@pytest.mark.parametrize("model", _all_models(), ids=lambda m: m.__name__)
def test_every_config_field_has_a_description(model: type[BaseModel]) -> None:
    missing = [name for name, f in model.model_fields.items() if not f.description]
    assert not missing, f"{model.__name__}: fields without description: {missing}"


def test_mis_discrepancy_weight_is_the_literature_variant() -> None:
    d = [[1.0, 3.0, 0.6], [1.5, 0.25, 1.0]]  # 3.0 and 0.25 leave [0.5, 2]
    one = make(S_STD, A_STD, d=d)
    weighted = make(S_STD, A_STD, d=d)
    out_one = decoupled_loss(one, DecoupledLossConfig(correction="mis"))
    cfg = DecoupledLossConfig(correction="mis", mis_weight="discrepancy")
    out_w = decoupled_loss(weighted, cfg)
    assert close(out_w.metrics["mis/masked_frac"], out_one.metrics["mis/masked_frac"])
    # kept tokens: gradient scaled by their d; masked tokens: still zero
    g_one, g_w = grad_of(one, out_one.loss), grad_of(weighted, out_w.loss)
    scale = torch.tensor([[1.0, 0.0, 0.6], [1.5, 0.0, 1.0]], dtype=F64)
    assert torch.allclose(g_w, g_one * scale, atol=1e-12)
    # seq 0: -1.2*1 + (masked) + -0.5*0.6; seq 1: +1.5*1.5 + (masked) + 1.0 -> 1.75 / 6
    assert close(out_w.loss, 1.75 / 6)
    assert close(out_w.metrics["mis/weight_mean"], (1.0 + 0.6 + 1.5 + 1.0) / 4)
    with pytest.raises(ValidationError):
        DecoupledLossConfig(mis_weight="d")  # type: ignore[arg-type]


def test_clip_and_mask_overlap_is_reported() -> None:
    # token (0, 0): s = 1.5 clipped high (A > 0) and d = 3 masked: both; (1, 1): s = 0.5
    # clipped low (A < 0), d = 1 kept: clipped only; (0, 2): d = 0.25 masked only.
    d = [[3.0, 1.0, 0.25], [1.0, 1.0, 1.0]]
    out = decoupled_loss(make(S_STD, A_STD, d=d), DecoupledLossConfig(correction="mis"))
    assert close(out.metrics["clip/frac"], 2 / 6)
    assert close(out.metrics["mis/masked_frac"], 2 / 6)
    assert close(out.metrics["clip/masked_overlap_frac"], 1 / 6)


def test_relaxed_rows_use_the_relaxed_clip_interval() -> None:
    # row 0 (A = +1) has ratio 1.5 at token 0: clipped at 1.2 normally, not under [0, 5]
    plain = make(S_STD, A_STD)
    relaxed = make(S_STD, A_STD, relaxed=torch.tensor([True, False]), relaxed_bounds=(0.0, 5.0))
    cfg = GrpoLossConfig()
    g_plain = grad_of(plain, grpo_loss(plain, cfg).loss)
    out = grpo_loss(relaxed, cfg)
    g_relaxed = grad_of(relaxed, out.loss)
    assert g_plain[0, 0] == 0.0 and g_relaxed[0, 0] == pytest.approx(-1.5 / 6)
    assert torch.equal(g_plain[1], g_relaxed[1])  # the other row keeps its own interval
    assert close(out.metrics["clip/relaxed_frac"], 0.5)
    assert close(out.metrics["clip/frac"], 1 / 6)  # only row 1's low clip is left
    dec = make(S_STD, A_STD, relaxed=torch.tensor([True, True]))
    assert close(decoupled_loss(dec, DecoupledLossConfig()).metrics["clip/frac"], 0.0)
    with pytest.raises(ValueError, match="relaxed"):
        make(S_STD, A_STD, relaxed=torch.tensor([True]))


def test_over_window_config_is_checked() -> None:
    from consumers.config import StalenessConfig

    assert StalenessConfig(max_staleness=4).route_limit() == 4
    assert StalenessConfig(max_staleness=4, over_window="relaxed_clip").route_limit() == 8
    relaxed = StalenessConfig(max_staleness=4, over_window="relaxed_clip", relaxed_max_staleness=5)
    assert relaxed.route_limit() == 5
    for bad in (
        {"relaxed_clip_bounds": [2.0, 1.0]},
        {"relaxed_clip_bounds": [1.0, 1.0]},
        {"over_window": "keep"},
        {"max_staleness": 4, "relaxed_max_staleness": 3},
    ):
        with pytest.raises(ValidationError):
            StalenessConfig.model_validate(bad)  # fmt: skip
