"""Typed configuration of the trainer's loss family.

No torch here: the trainer parses and validates its loss section before importing anything
heavy. A loss is chosen by its ``type`` field (a pydantic discriminated union):

=============  =============================================================================
``type``       what it optimises
=============  =============================================================================
``grpo``       plain PPO/GRPO on the total ratio ``r = exp(logp_new - logp_infer)``; the
               baseline that ignores the decomposition ``r = d · s``.
``decoupled``  the discrepancy ``d = exp(logp_old - logp_infer)`` corrected by TIS
               (truncate) or MIS (mask) at token, sequence or geometric-mean level, plus a
               catastrophic-token veto; the staleness ``s = exp(logp_new - logp_old)``
               clipped by PPO with its own ε_low/ε_high.
``mu_grpo``    Mu-GRPO: a relaxed clip interval (e.g. [0, 5]) on the ratio plus
               the negative-advantage veto (NAV) with a configurable trigger rule.
``ppo_ewma``   the decoupled loss with ``logp_prox`` (log-probs under an EWMA of past
               weights, see ``consumers.ewma``) in place of the missing ``logp_old``, plus
               the EWMA decay and its automatic-reset threshold.
=============  =============================================================================

Every field has a description; it is the field's ``--help``. Unknown keys are errors and
instances are immutable. In TOML a bounds pair is an array: ``token_bounds = [0.5, 2.0]``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, field_validator, model_validator

from core.config import StrictModel

Aggregation = Literal["token_mean", "seq_mean", "seq_mean_token_sum"]
Bounds = tuple[float, float]


def _check_bounds(value: Bounds, name: str) -> Bounds:
    low, high = value
    if not (0.0 <= low <= 1.0 <= high):
        raise ValueError(f"{name} must satisfy 0 <= low <= 1 <= high, got {value}")
    if low == high:
        raise ValueError(f"{name} is empty: low == high == {low}")
    return value


class _LossBase(StrictModel):
    """Fields every loss variant shares. A clip bound may be infinite (no bound on that
    side); NaN is refused, as everywhere."""

    model_config = ConfigDict(allow_inf_nan=True)

    @field_validator("dual_clip")
    @classmethod
    def _infinite_dual_clip_is_none(cls, value: float | None) -> float | None:
        """TOML has no null: ``dual_clip = inf`` is how a file turns the clip off."""
        return None if value == math.inf else value

    @model_validator(mode="after")
    def _no_nan(self) -> _LossBase:
        for name, value in self:
            values = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and math.isnan(v) for v in values):
                raise ValueError(f"{name} is NaN")
        return self

    aggregation: Aggregation = Field(
        default="token_mean",
        description=(
            "How per-token losses become one number. token_mean: sum over all response tokens "
            "of the batch / number of response tokens. seq_mean: mean over each sequence's "
            "response tokens, then mean over sequences with at least one response token. "
            "seq_mean_token_sum: sum over each sequence's tokens, then mean over those "
            "sequences. Denominators count response tokens (the input mask); tokens dropped "
            "by MIS, the veto or NAV add zero but are not taken out of the denominator."
        ),
    )
    dual_clip: float | None = Field(
        default=3.0,
        gt=1.0,
        description=(
            "Dual clip: a token with A < 0 adds at most dual_clip·|A| to the loss, and no "
            "gradient once its ratio exceeds dual_clip. The PPO surrogate alone is "
            "ratio·|A| there, unbounded: one token whose probability jumped a hundredfold "
            "since it was sampled can dominate a batch. None (inf in TOML): the plain surrogate."
        ),
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description=(
            "Weight of the KL penalty to a reference policy (k3 estimator, needs logp_ref). "
            "0 disables the penalty; kl/ref_k3 is still reported when logp_ref is given."
        ),
    )


class GrpoLossConfig(_LossBase):
    """Plain PPO/GRPO clipping of the total ratio r = exp(logp_new - logp_infer)."""

    type: Literal["grpo"] = Field(default="grpo", description="Selects plain GRPO/PPO.")
    eps_low: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="Lower clip: r is clipped at 1 - eps_low (matters for A < 0).",
    )
    eps_high: float = Field(
        default=0.2,
        ge=0.0,
        description="Upper clip: r is clipped at 1 + eps_high (matters for A > 0).",
    )


class _DecoupledFields(_LossBase):
    """Discrepancy correction (TIS/MIS, veto) and staleness clipping shared by the
    ``decoupled`` and ``ppo_ewma`` variants."""

    correction: Literal["tis", "mis"] = Field(
        default="mis",
        description=(
            "How the discrepancy d = exp(logp_anchor - logp_infer) is corrected. tis: each "
            "token's surrogate is weighted by min(d_level, high) (truncated importance "
            "sampling; the weight carries no gradient). mis: tokens (token level) or whole "
            "sequences (sequence/geometric level) whose d_level leaves [low, high] are dropped."
        ),
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        default="token",
        description=(
            "Granularity of d_level. token: d per token. sequence: the product of d over the "
            "sequence's response tokens. geometric: the geometric mean of d over them, "
            "exp(mean log d). Sequence-level values apply to every token of the sequence."
        ),
    )
    token_bounds: Bounds = Field(
        default=(0.5, 2.0),
        description=(
            "[low, high] for level=token. MIS keeps tokens with low <= d <= high; TIS "
            "truncates the weight at high (low unused). The default is a guard against "
            "broken numerics: a normal bf16/fp32 mismatch never leaves it (largest measured "
            "|log d|: 0.004 on the tiny model, 0.25 on SmolLM2-135M)."
        ),
    )
    sequence_bounds: Bounds = Field(
        default=(0.5, 2.0),
        description=(
            "[low, high] for level=sequence (product of d). MIS keeps a sequence when "
            "low <= prod d <= high; TIS truncates the weight at high."
        ),
    )
    geometric_bounds: Bounds = Field(
        default=(1.0 / 1.02, 1.02),
        description=(
            "[low, high] for level=geometric (geometric mean of d). The default keeps every "
            "sequence of a normal bf16-engine / fp32-trainer mismatch (measured on "
            "SmolLM2-135M: 99.9% of sequences within 1.016) and masks real divergence; the "
            "tight values used where engine and trainer share numerics (1.001-1.004) mask "
            "most sequences of such a mismatch (75% at 1.002). MIS keeps a sequence inside "
            "the interval; TIS truncates the weight at high."
        ),
    )
    mis_weight: Literal["one", "discrepancy"] = Field(
        default="one",
        description=(
            "Weight of the tokens MIS keeps. one: the mask only (kept tokens train as if "
            "d = 1). discrepancy: the masked importance sampling of the literature, kept "
            "tokens weighted by d_level (no gradient), as TIS does below its cap."
        ),
    )
    catastrophic_threshold: float | None = Field(
        default=1e-4,
        gt=0.0,
        description=(
            "Catastrophic-token veto: drop a whole sequence if any of its response tokens has "
            "d < this value (applies to TIS and MIS alike). None disables the veto."
        ),
    )
    staleness_eps_low: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="PPO clip of the staleness ratio s = exp(logp_new - logp_anchor): lower "
        "bound 1 - staleness_eps_low.",
    )
    staleness_eps_high: float = Field(
        default=0.2,
        ge=0.0,
        description="PPO clip of the staleness ratio s: upper bound 1 + staleness_eps_high.",
    )

    @field_validator("token_bounds", "sequence_bounds", "geometric_bounds")
    @classmethod
    def _bounds(cls, value: Bounds, info: Any) -> Bounds:
        return _check_bounds(value, info.field_name)

    def bounds(self) -> Bounds:
        """The [low, high] pair of the configured level."""
        return {
            "token": self.token_bounds,
            "sequence": self.sequence_bounds,
            "geometric": self.geometric_bounds,
        }[self.level]


class DecoupledLossConfig(_DecoupledFields):
    """Decoupled PPO: d corrected by TIS/MIS, s clipped by PPO (needs exact logp_old)."""

    type: Literal["decoupled"] = Field(
        default="decoupled", description="Selects decoupled PPO with exact old log-probs."
    )


class PpoEwmaLossConfig(_DecoupledFields):
    """Decoupled PPO with logp_prox (EWMA proximal policy) in place of logp_old."""

    type: Literal["ppo_ewma"] = Field(
        default="ppo_ewma",
        description="Selects the approximate route: the decoupled loss anchored on logp_prox.",
    )
    beta: float = Field(
        default=0.75,
        ge=0.0,
        lt=1.0,
        description=(
            "EWMA decay of the proximal weights: W' = beta*W + 1, "
            "theta_prox <- (beta*W/W')*theta_prox + theta/W'. 0 makes theta_prox the "
            "current weights; larger values remember longer (0.4-0.75 are typical)."
        ),
    )
    reset_below: float | None = Field(
        default=0.8,
        ge=0.0,
        le=1.0,
        description=(
            "Automatic reset: when the train-infer kept fraction of a step "
            "(metric train_infer/kept_frac) is strictly below this value, the trainer resets "
            "theta_prox to the current weights. None disables. The default is our "
            "choice."
        ),
    )
    reset_rule: Literal["below", "drop"] = Field(
        default="drop",
        description=(
            "below: reset when train_infer/kept_frac < reset_below. drop: reset when it is "
            "below reset_below times its running level (a sudden fall); unlike below, it "
            "does not reset at every step under a tight MIS band. Near a kept fraction of 1 "
            "the two agree."
        ),
    )


class NavConfig(StrictModel):
    """Negative-advantage veto (Mu-GRPO). For every token with A < 0 that comes strictly after
    the first trigger token of its sequence, the gradient is dropped. The trigger token
    itself is kept unless ``include_trigger``."""

    trigger: Literal["ratio_above", "logp_below"] = Field(
        default="ratio_above",
        description=(
            "Trigger rule. ratio_above (Mu-GRPO's rule): the first response token "
            "whose ratio (the same ratio the surrogate clips, without gradient) is strictly "
            "greater than kappa. logp_below (our alternative): the first response token that "
            "the sampler drew with logp_infer strictly below logp_threshold."
        ),
    )
    kappa: float = Field(
        default=2.0,
        gt=0.0,
        description="Ratio threshold for trigger=ratio_above. The value is our choice.",
    )
    logp_threshold: float = Field(
        default=-9.21,
        lt=0.0,
        description="logp_infer threshold for trigger=logp_below (-9.21 is log 1e-4).",
    )
    include_trigger: bool = Field(
        default=False,
        description=(
            "False (default): drop only the tokens strictly after the trigger, the trigger "
            "token keeps its gradient (Mu-GRPO's 'non-trigger suffix'). True: drop it too."
        ),
    )


class MuGrpoLossConfig(_LossBase):
    """Mu-GRPO: relaxed clipping plus the negative-advantage veto."""

    type: Literal["mu_grpo"] = Field(default="mu_grpo", description="Selects Mu-GRPO.")
    ratio_source: Literal["total", "staleness"] = Field(
        default="total",
        description=(
            "Which ratio is clipped and tested by NAV. total: r = exp(logp_new - logp_infer) "
            "(Mu-GRPO's choice). staleness: s = exp(logp_new - logp_old), needs logp_old."
        ),
    )
    clip_bounds: Bounds = Field(
        default=(0.0, 5.0),
        description=(
            "Relaxed clip interval [low, high] on the ratio itself (not 1 ± eps); "
            "Mu-GRPO uses [0, 5]. Surrogate: -min(ratio*A, clip(ratio, low, high)*A)."
        ),
    )
    nav: NavConfig | None = Field(
        default_factory=NavConfig,
        description="Negative-advantage veto settings; None disables NAV.",
    )
    dual_clip: float | None = Field(
        default=None,
        gt=1.0,
        description=(
            "As for the other losses, but off by default: Mu-GRPO bounds negative-advantage "
            "tokens with NAV and its relaxed interval instead."
        ),
    )

    @field_validator("clip_bounds")
    @classmethod
    def _clip(cls, value: Bounds) -> Bounds:
        return _check_bounds(value, "clip_bounds")


LossConfig = Annotated[
    GrpoLossConfig | DecoupledLossConfig | MuGrpoLossConfig | PpoEwmaLossConfig,
    Field(discriminator="type"),
]

_ADAPTER: TypeAdapter[LossConfig] = TypeAdapter(LossConfig)


def parse_loss_config(data: dict[str, Any]) -> LossConfig:
    """Validate a loss section (e.g. from TOML) into the variant its ``type`` names."""
    return _ADAPTER.validate_python(data)
