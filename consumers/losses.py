"""The trainer's loss family, one readable function per variant.

Every variant has the signature ``loss_fn(inputs: LossInputs, config) -> LossOutput`` and
is written in the same order (after CleanRL's PPO): log-ratios → diagnostics without
gradient → masks and weights → clipped surrogate → aggregation (→ KL to a reference).
``compute_loss(config, inputs)`` picks the function from ``config.type``.

Log-probabilities, per response token ``y_t`` (shapes ``[B, T]``):

- ``logp_infer``: log π_infer(y_t; θ_v), recorded by the inference engine that sampled it;
- ``logp_old``: log π_train(y_t; θ_v), training-side numerics at the same version v;
- ``logp_new``: log π_train(y_t; θ_n), the policy being optimised (carries the gradient);
- ``logp_prox``: log-prob under the EWMA proximal weights (``consumers.ewma``);
- ``logp_ref``: log-prob under a frozen reference policy (for the KL penalty).

Ratios: total ``r = exp(logp_new - logp_infer)`` = discrepancy ``d = exp(logp_old -
logp_infer)`` × staleness ``s = exp(logp_new - logp_old)``. The PPO surrogate of a ratio
``ρ`` with clip interval ``[lo, hi]`` is ``-min(ρ·A, clip(ρ, lo, hi)·A)`` per token; with a
dual clip ``c`` (Ye et al., 2020) it is further capped at ``c·|A|`` where A < 0, where the
surrogate alone grows with ρ without bound.

Conventions:

- Arithmetic runs in float32 (float64 if the inputs are float64); bf16 inputs are upcast.
- Positions outside the response mask are replaced by 0 before any arithmetic, so padding
  may hold anything (even NaN or -inf) without reaching the loss or the gradient.
- Denominators count response tokens (the input ``mask``). Tokens dropped by MIS, the
  catastrophic veto or NAV contribute zero but stay in the denominator: dropping a token
  never rescales the gradient of the others.
- An empty mask gives a loss of exactly 0 (still attached to the graph) and finite metrics.
- TIS weights and MIS/veto/NAV masks carry no gradient; only ``logp_new`` does.

Metrics (``LossOutput.metrics``, plain floats, fetched from the device in one transfer).
Token fractions are over response tokens and computed independently of each other (a token
can be both MIS-masked and PPO-clipped); all of them are 0 for an empty mask except
``train_infer/kept_frac``, which is then 1.

=========================  ===================  =================================================
metric                     variants             meaning
=========================  ===================  =================================================
``loss/total``             all                  the returned loss: policy + kl_coef · KL term
``loss/policy``            all                  aggregated clipped surrogate (with TIS weights
                                                and masks applied)
``loss/kl``                all, if logp_ref     kl_coef × aggregated k3 to the reference
``tokens/response``        all                  number of response tokens in the batch
``ratio/mean``             all                  mean of the ratio the surrogate clips: r (grpo,
                                                mu_grpo total), s (decoupled, mu_grpo
                                                staleness), exp(logp_new - logp_prox) (ppo_ewma)
``ratio/max``              all                  max of that ratio
``clip/frac``              all                  fraction of tokens whose gradient is cut by a
                                                clip: (A > 0 and ρ > hi) or (A < 0 and ρ < lo)
                                                or (A < 0 and ρ > dual_clip)
``clip/frac_low``          all                  the A < 0, ρ < lo part of clip/frac
``clip/frac_high``         all                  the A > 0, ρ > hi part of clip/frac
``clip/frac_dual``         all                  the A < 0, ρ > dual_clip part of clip/frac (0
                                                when dual_clip is None)
``clip/masked_overlap_``   decoupled, ppo_ewma, fraction of tokens both clipped and dropped by
``frac``                   mu_grpo with NAV     the mask (MIS, veto or NAV): how much the two
                                                token sets overlap
``discrepancy/mean``       decoupled, ppo_ewma  mean token discrepancy d (anchor vs infer)
``tis/truncated_frac``     correction=tis       fraction of tokens whose weight d_level > high
                                                was truncated (sequence levels: all tokens of
                                                a truncated sequence count)
``tis/weight_mean``        correction=tis       mean TIS weight min(d_level, high)
``mis/weight_mean``        mis_weight=          mean weight d_level of the tokens MIS keeps
                          discrepancy
``mis/masked_frac``        correction=mis       fraction of tokens dropped by the MIS interval
                                                (not counting the catastrophic veto)
``mis/masked_seqs``        mis, sequence levels number of sequences dropped by the interval
``veto/catastrophic_seqs`` decoupled, ppo_ewma  number of sequences dropped because some token
                                                has d < catastrophic_threshold
``train_infer/kept_frac``  decoupled, ppo_ewma  fraction of tokens kept by the train-inference
                                                correction (MIS and veto): the
                                                train-inference mask; the PPO-EWMA reset input
``nav/vetoed_frac``        mu_grpo with NAV     fraction of tokens whose gradient NAV dropped
``nav/vetoed_seqs``        mu_grpo with NAV     number of sequences with at least one vetoed
                                                token
``mismatch/k3_kl``         all, if logp_old     train-inference mismatch, mean over tokens of
                                                k3(x) = exp(x) - 1 - x with x = logp_old -
                                                logp_infer = log d: an unbiased estimate of
                                                KL(π_infer ‖ π_old), since the tokens were
                                                sampled from π_infer; always ≥ 0
``prox/k3_kl``             ppo_ewma             the same with logp_prox in place of logp_old:
                                                KL(π_infer ‖ π_prox)
``kl/ref_k3``              all, if logp_ref     mean over tokens of k3(x), x = logp_ref -
                                                logp_new: Schulman's estimator of
                                                KL(π_new ‖ π_ref) (exact in expectation for
                                                tokens sampled from π_new; here they come from
                                                π_infer, the usual GRPO approximation)
=========================  ===================  =================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from consumers.loss_config import (
    DecoupledLossConfig,
    GrpoLossConfig,
    LossConfig,
    MuGrpoLossConfig,
    PpoEwmaLossConfig,
    _DecoupledFields,
    _LossBase,
)

__all__ = [
    "LossInputs",
    "LossOutput",
    "compute_loss",
    "decoupled_loss",
    "grpo_loss",
    "k3",
    "mu_grpo_loss",
    "ppo_ewma_loss",
]


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """One batch of response tokens. All log-prob tensors are ``[B, T]``.

    ``logp_new`` carries the gradient; every other tensor is treated as a constant.
    ``advantages`` is ``[B]`` (one per sequence, GRPO) or ``[B, T]`` (per token).
    ``mask`` (bool or 0/1 float) marks response tokens; nonzero means "in the loss".
    """

    logp_new: Tensor
    logp_old: Tensor | None = None
    logp_infer: Tensor
    advantages: Tensor
    mask: Tensor
    logp_ref: Tensor | None = None
    logp_prox: Tensor | None = None
    #: ``[B]`` bool: rows trained past the staleness window, clipped with ``relaxed_bounds``
    #: instead of the loss's own interval (``[trainer.staleness] over_window``)
    relaxed: Tensor | None = None
    relaxed_bounds: tuple[float, float] = (0.0, 5.0)

    def __post_init__(self) -> None:
        if self.logp_new.dim() != 2:
            raise ValueError(f"logp_new must be [B, T], got {tuple(self.logp_new.shape)}")
        shape = self.logp_new.shape
        for name in ("logp_old", "logp_infer", "mask", "logp_ref", "logp_prox"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
        if self.relaxed is not None and self.relaxed.shape != shape[:1]:
            raise ValueError(f"relaxed must be [B] = {shape[0]}, got {tuple(self.relaxed.shape)}")
        if self.advantages.shape not in (shape[:1], shape):
            raise ValueError(
                f"advantages must be [B] or [B, T] = {tuple(shape)}, "
                f"got {tuple(self.advantages.shape)}"
            )


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss to backpropagate and its namespaced diagnostics (see module doc)."""

    loss: Tensor
    metrics: dict[str, float]


def k3(x: Tensor) -> Tensor:
    """Schulman's k3 estimator term ``exp(x) - 1 - x`` (≥ 0). With ``x = log(p/q)`` at a
    token sampled from q, its expectation is KL(q ‖ p)."""
    return torch.expm1(x) - x


# --------------------------------------------------------------------------------------
# Shared pieces: input preparation, surrogate, aggregation, KL, metric export.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    mask: Tensor  # [B, T] bool, response tokens
    adv: Tensor  # [B, T] advantages, 0 outside the mask, no gradient
    n_tokens: Tensor  # number of response tokens (float scalar)
    dtype: torch.dtype

    def take(self, logp: Tensor) -> Tensor:
        """``logp`` in the compute dtype with 0 outside the mask (gradient kept)."""
        return torch.where(self.mask, logp.to(self.dtype), 0.0)

    def mean(self, x: Tensor) -> Tensor:
        """Mean of ``x`` over response tokens; 0 for an empty mask."""
        return torch.where(self.mask, x, 0.0).sum() / self.n_tokens.clamp(min=1.0)

    def frac(self, flags: Tensor) -> Tensor:
        """Fraction of response tokens where ``flags`` holds; 0 for an empty mask."""
        return (flags & self.mask).sum() / self.n_tokens.clamp(min=1.0)

    def max(self, x: Tensor) -> Tensor:
        """Max of a non-negative ``x`` over response tokens; 0 for an empty mask."""
        return torch.where(self.mask, x, 0.0).max()


def _prepare(inputs: LossInputs) -> _Batch:
    dtype = torch.promote_types(inputs.logp_new.dtype, torch.float32)
    mask = inputs.mask if inputs.mask.dtype == torch.bool else inputs.mask != 0
    adv = inputs.advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)
    adv = torch.where(mask, adv, 0.0)
    return _Batch(mask=mask, adv=adv, n_tokens=mask.sum().to(dtype), dtype=dtype)


def _clip_interval(
    inputs: LossInputs, low: float, high: float, metrics: dict[str, Tensor | float], batch: _Batch
) -> tuple[float | Tensor, float | Tensor]:
    """The loss's clip interval, or per row ``[B, 1]`` bounds where rows are relaxed."""
    if inputs.relaxed is None or not bool(inputs.relaxed.any()):
        return low, high
    rows = inputs.relaxed.to(batch.mask.device)[:, None]
    r_low, r_high = inputs.relaxed_bounds
    metrics["clip/relaxed_frac"] = batch.frac(rows.expand_as(batch.mask))
    low_t = torch.where(rows, r_low, low).to(batch.dtype)
    high_t = torch.where(rows, r_high, high).to(batch.dtype)
    return low_t, high_t


def _ratio_metrics(batch: _Batch, ratio: Tensor) -> dict[str, Tensor | float]:
    """The diagnostics every variant starts its metrics with (no gradient)."""
    with torch.no_grad():
        return {
            "tokens/response": batch.n_tokens,
            "ratio/mean": batch.mean(ratio),
            "ratio/max": batch.max(ratio),
        }


def _clipped_surrogate(
    ratio: Tensor,
    batch: _Batch,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip: float | None,
    metrics: dict[str, Tensor | float],
) -> tuple[Tensor, Tensor]:
    """Per-token ``-min(ratio·A, clip(ratio, low, high)·A)``, capped at ``dual_clip·|A|``
    where A < 0, and where a clip cuts the gradient (below ``low`` with A < 0; above
    ``high`` with A > 0; above ``dual_clip`` with A < 0), with the ``clip/frac*`` metrics
    of those cuts."""
    adv = batch.adv
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, low, high) * adv  # bounds: numbers, or [B, 1] per row
    per_token = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    with torch.no_grad():
        clipped_low = (adv < 0) & (ratio < low)
        clipped_high = (adv > 0) & (ratio > high)
        if dual_clip is None:
            clipped_dual = torch.zeros_like(batch.mask)
        else:
            clipped_dual = (adv < 0) & (ratio > dual_clip)
    metrics["clip/frac_low"] = batch.frac(clipped_low)
    metrics["clip/frac_high"] = batch.frac(clipped_high)
    metrics["clip/frac_dual"] = batch.frac(clipped_dual)
    cut = clipped_low | clipped_high | clipped_dual
    metrics["clip/frac"] = batch.frac(cut)
    return per_token, cut


def _aggregate(per_token: Tensor, keep: Tensor, batch: _Batch, mode: str) -> Tensor:
    """Reduce per-token losses; ``keep`` zeroes dropped tokens, denominators use the
    response mask (see the module doc)."""
    contribution = torch.where(keep & batch.mask, per_token, 0.0)
    if mode == "token_mean":
        return contribution.sum() / batch.n_tokens.clamp(min=1.0)
    seq_len = batch.mask.sum(dim=1).to(batch.dtype)
    seq_sum = contribution.sum(dim=1)
    if mode == "seq_mean":
        per_seq = seq_sum / seq_len.clamp(min=1.0)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    n_seqs = (seq_len > 0).sum().to(batch.dtype)
    return per_seq.sum() / n_seqs.clamp(min=1.0)


def _with_kl(
    policy: Tensor,
    new: Tensor,
    inputs: LossInputs,
    batch: _Batch,
    config: _LossBase,
    metrics: dict[str, Tensor | float],
) -> Tensor:
    """Add ``kl_coef × aggregate(k3(logp_ref - logp_new))`` and its metrics."""
    metrics["loss/policy"] = policy.detach()
    if inputs.logp_ref is None:
        if config.kl_coef > 0:
            raise ValueError("kl_coef > 0 needs logp_ref")
        metrics["loss/total"] = policy.detach()
        return policy
    ref = batch.take(inputs.logp_ref).detach()
    kl_per_token = k3(ref - new)
    kl = _aggregate(kl_per_token, batch.mask, batch, config.aggregation)
    metrics["kl/ref_k3"] = batch.mean(kl_per_token.detach())
    total = policy + config.kl_coef * kl if config.kl_coef > 0 else policy
    metrics["loss/kl"] = (config.kl_coef * kl).detach()
    metrics["loss/total"] = total.detach()
    return total


def _mismatch(inputs: LossInputs, batch: _Batch, metrics: dict[str, Tensor | float]) -> None:
    """``mismatch/k3_kl`` = mean k3(logp_old - logp_infer) ≈ KL(π_infer ‖ π_old)."""
    if inputs.logp_old is None:
        return
    with torch.no_grad():
        log_d = batch.take(inputs.logp_old) - batch.take(inputs.logp_infer)
        metrics["mismatch/k3_kl"] = batch.mean(k3(log_d))


def _finish(loss: Tensor, metrics: dict[str, Tensor | float]) -> LossOutput:
    """Convert tensor metrics to floats with a single device transfer."""
    names = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values: dict[str, float] = {
        k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)
    }
    if names:
        stacked = torch.stack([metrics[k].detach().to(torch.float64) for k in names])  # type: ignore[union-attr]
        values.update(zip(names, stacked.tolist(), strict=True))
    return LossOutput(loss=loss, metrics=dict(sorted(values.items())))


# --------------------------------------------------------------------------------------
# Variants.
# --------------------------------------------------------------------------------------


def grpo_loss(inputs: LossInputs, config: GrpoLossConfig) -> LossOutput:
    """Plain PPO/GRPO on the total ratio r = exp(logp_new - logp_infer)."""
    batch = _prepare(inputs)
    new = batch.take(inputs.logp_new)
    infer = batch.take(inputs.logp_infer).detach()

    # 1. log-ratio
    log_ratio = new - infer
    ratio = torch.exp(log_ratio)

    # 2. diagnostics without gradient
    metrics = _ratio_metrics(batch, ratio)
    _mismatch(inputs, batch, metrics)

    # 3. masks / weights: the response mask only

    # 4. clipped surrogate
    low, high = _clip_interval(inputs, 1.0 - config.eps_low, 1.0 + config.eps_high, metrics, batch)
    per_token, _clipped = _clipped_surrogate(ratio, batch, low, high, config.dual_clip, metrics)

    # 5. aggregation (+ KL to the reference)
    policy = _aggregate(per_token, batch.mask, batch, config.aggregation)
    loss = _with_kl(policy, new, inputs, batch, config, metrics)
    return _finish(loss, metrics)


def _decoupled(
    inputs: LossInputs, config: _DecoupledFields, logp_anchor: Tensor
) -> tuple[Tensor, dict[str, Tensor | float], _Batch, Tensor]:
    """The decoupled loss anchored on ``logp_anchor`` (logp_old or logp_prox)."""
    batch = _prepare(inputs)
    new = batch.take(inputs.logp_new)
    infer = batch.take(inputs.logp_infer).detach()
    anchor = batch.take(logp_anchor).detach()

    # 1. log-ratios: log r = log d + log s
    log_d = anchor - infer  # discrepancy, same version, no gradient
    log_s = new - anchor  # staleness, carries the gradient
    s = torch.exp(log_s)

    # 2. diagnostics without gradient
    metrics = _ratio_metrics(batch, s)
    with torch.no_grad():
        d = torch.exp(log_d)
        metrics["discrepancy/mean"] = batch.mean(d)

    # 3. masks / weights from d (no gradient)
    with torch.no_grad():
        mis_low, mis_high = config.bounds()
        if config.level == "token":
            d_level = d
        else:
            seq_log_d = log_d.sum(dim=1)  # log of the product over response tokens
            if config.level == "geometric":
                seq_len = batch.mask.sum(dim=1).to(batch.dtype)
                seq_log_d = seq_log_d / seq_len.clamp(min=1.0)
            d_level = torch.exp(seq_log_d)[:, None].expand_as(d)

        if config.correction == "tis":
            weight = torch.clamp(d_level, max=mis_high)
            keep = batch.mask.clone()
            metrics["tis/truncated_frac"] = batch.frac(d_level > mis_high)
            metrics["tis/weight_mean"] = batch.mean(weight)
        else:
            weight = d_level if config.mis_weight == "discrepancy" else torch.ones_like(d)
            keep = batch.mask & (d_level >= mis_low) & (d_level <= mis_high)
            metrics["mis/masked_frac"] = batch.frac(~keep)
            if config.mis_weight == "discrepancy":
                kept_weights = torch.where(keep & batch.mask, weight, 0.0)
                n_kept = (keep & batch.mask).sum().clamp(min=1)
                metrics["mis/weight_mean"] = kept_weights.sum() / n_kept
            if config.level != "token":
                has_tokens = batch.mask.any(dim=1)
                metrics["mis/masked_seqs"] = (has_tokens & ~keep.any(dim=1)).sum()

        if config.catastrophic_threshold is not None:
            vetoed_seq = ((d < config.catastrophic_threshold) & batch.mask).any(dim=1)
        else:
            vetoed_seq = torch.zeros_like(batch.mask[:, 0])
        keep = keep & ~vetoed_seq[:, None]
        metrics["veto/catastrophic_seqs"] = vetoed_seq.sum()
        kept = (keep & batch.mask).sum() / batch.n_tokens
        metrics["train_infer/kept_frac"] = torch.where(batch.n_tokens > 0, kept, 1.0)

    # 4. clipped surrogate on s, weighted by TIS
    low, high = _clip_interval(
        inputs, 1.0 - config.staleness_eps_low, 1.0 + config.staleness_eps_high, metrics, batch
    )
    per_token, clipped = _clipped_surrogate(s, batch, low, high, config.dual_clip, metrics)
    per_token = weight * per_token
    metrics["clip/masked_overlap_frac"] = batch.frac(clipped & ~keep)

    # 5. aggregation (KL added by the caller)
    policy = _aggregate(per_token, keep, batch, config.aggregation)
    return policy, metrics, batch, new


def decoupled_loss(inputs: LossInputs, config: DecoupledLossConfig) -> LossOutput:
    """Decoupled PPO: d = exp(logp_old - logp_infer) by TIS/MIS (+ veto), s clipped by PPO."""
    if inputs.logp_old is None:
        raise ValueError("the decoupled loss needs logp_old (exact old log-probs)")
    policy, metrics, batch, new = _decoupled(inputs, config, inputs.logp_old)
    _mismatch(inputs, batch, metrics)
    loss = _with_kl(policy, new, inputs, batch, config, metrics)
    return _finish(loss, metrics)


def ppo_ewma_loss(inputs: LossInputs, config: PpoEwmaLossConfig) -> LossOutput:
    """The decoupled loss with logp_prox (EWMA proximal policy) in place of logp_old.

    ``config.beta`` and ``config.reset_below`` are used by the trainer with
    ``consumers.ewma.EwmaProximal``; this function reports ``train_infer/kept_frac``, the
    input of ``EwmaProximal.should_reset``.
    """
    if inputs.logp_prox is None:
        raise ValueError("the ppo_ewma loss needs logp_prox")
    policy, metrics, batch, new = _decoupled(inputs, config, inputs.logp_prox)
    with torch.no_grad():
        log_d_prox = batch.take(inputs.logp_prox) - batch.take(inputs.logp_infer)
        metrics["prox/k3_kl"] = batch.mean(k3(log_d_prox))
    _mismatch(inputs, batch, metrics)
    loss = _with_kl(policy, new, inputs, batch, config, metrics)
    return _finish(loss, metrics)


def mu_grpo_loss(inputs: LossInputs, config: MuGrpoLossConfig) -> LossOutput:
    """Mu-GRPO: relaxed clipping of the ratio plus the negative-advantage veto (NAV).

    NAV: in each sequence, the trigger is the first response token that meets the rule
    (``ratio_above``: ratio > kappa; ``logp_below``: logp_infer < logp_threshold). Every
    response token strictly after it whose advantage is negative loses its gradient; the
    trigger token itself too when ``include_trigger``. Tokens before the trigger, and all
    tokens with A >= 0, are untouched.
    """
    batch = _prepare(inputs)
    new = batch.take(inputs.logp_new)
    infer = batch.take(inputs.logp_infer).detach()
    if config.ratio_source == "total":
        anchor = infer
    elif inputs.logp_old is None:
        raise ValueError("mu_grpo with ratio_source='staleness' needs logp_old")
    else:
        anchor = batch.take(inputs.logp_old).detach()

    # 1. log-ratio
    log_ratio = new - anchor
    ratio = torch.exp(log_ratio)

    # 2. diagnostics without gradient
    metrics = _ratio_metrics(batch, ratio)
    _mismatch(inputs, batch, metrics)

    # 3. masks: negative-advantage veto
    keep = batch.mask
    if config.nav is not None:
        with torch.no_grad():
            if config.nav.trigger == "ratio_above":
                trigger = (ratio > config.nav.kappa) & batch.mask
            else:
                trigger = (infer < config.nav.logp_threshold) & batch.mask
            seen = torch.cumsum(trigger.to(torch.int32), dim=1)  # triggers at or before t
            if config.nav.include_trigger:
                in_suffix = seen > 0
            else:
                in_suffix = (seen - trigger.to(torch.int32)) > 0  # strictly after the first
            vetoed = in_suffix & (batch.adv < 0) & batch.mask
            keep = batch.mask & ~vetoed
            metrics["nav/vetoed_frac"] = batch.frac(vetoed)
            metrics["nav/vetoed_seqs"] = vetoed.any(dim=1).sum()

    # 4. relaxed clipped surrogate
    low, high = config.clip_bounds
    per_token, clipped = _clipped_surrogate(ratio, batch, low, high, config.dual_clip, metrics)
    if config.nav is not None:
        metrics["clip/masked_overlap_frac"] = batch.frac(clipped & ~keep)

    # 5. aggregation (+ KL to the reference)
    policy = _aggregate(per_token, keep, batch, config.aggregation)
    loss = _with_kl(policy, new, inputs, batch, config, metrics)
    return _finish(loss, metrics)


def compute_loss(config: LossConfig, inputs: LossInputs) -> LossOutput:
    """Dispatch on ``config.type``."""
    match config:
        case GrpoLossConfig():
            return grpo_loss(inputs, config)
        case DecoupledLossConfig():
            return decoupled_loss(inputs, config)
        case MuGrpoLossConfig():
            return mu_grpo_loss(inputs, config)
        case PpoEwmaLossConfig():
            return ppo_ewma_loss(inputs, config)
    raise TypeError(f"unknown loss config {type(config).__name__}")
