"""The trainer's profile of the record contract: what one training step cannot take.

A scored group reaches the trainer after the stream validated each sample
(``schemas.validation.validate``) and attached its advantage and old log-probs. The
trainer checks again only what would break its step or poison a whole batch's loss,
under its own limits (``ValidationLimits.vocab_size`` and ``max_total_tokens``: its
model's vocabulary and context), and reports the **first** problem as a ``Defect`` whose
``Reason`` names the dead-letter reason: a group is refused whole, so one reason is enough.
"""

from __future__ import annotations

import numpy as np

from schemas.group import ScoredGroup
from schemas.trajectory import OldLogitsStatus, Trajectory
from schemas.validation import Defect, Reason, ValidationLimits


def check_trainable(traj: Trajectory, limits: ValidationLimits) -> Defect | None:
    """Why ``traj`` cannot be trained under ``limits``, or None: the first problem found,
    in this order (inputs, log-prob lengths, size, log-prob values, layout)."""
    return (
        _missing_input(traj)
        or _logprob_lengths(traj)
        or _size(traj, limits)
        or _nonfinite_logprobs(traj)
        or _layout(traj)
    )


def check_trainable_group(
    group: ScoredGroup, limits: ValidationLimits, policy: str = ""
) -> Defect | None:
    """Why ``group`` cannot be trained by ``policy``'s trainer, or None: a sample of
    another policy (never another policy's tokens in this batch), an untrainable sample
    (its detail names the trajectory), or no sample at all."""
    for traj in group.samples:
        if traj.policy != policy:
            return Defect(
                Reason.FOREIGN_POLICY,
                "policy",
                f"trajectory {traj.trajectory_id} is policy {traj.policy!r}, "
                f"this trainer trains {policy!r}",
            )
        defect = check_trainable(traj, limits)
        if defect is not None:
            detail = f"trajectory {traj.trajectory_id}: {defect.detail}"
            return Defect(defect.reason, defect.field, detail)
    if not group.samples:
        return Defect(Reason.EMPTY_GROUP, "samples", f"group {group.group_id} has no samples")
    return None


def _missing_input(traj: Trajectory) -> Defect | None:
    """No prompt token to predict the first response token from, or no usable advantage."""
    if traj.num_prompt_tokens < 1:
        return Defect(
            Reason.EMPTY_PROMPT,
            "prompt_ids",
            "the first response token needs a prompt token before it",
        )
    if traj.advantage is None or not np.isfinite(traj.advantage):
        return Defect(Reason.BAD_ADVANTAGE, "advantage", repr(traj.advantage))
    return None


def _logprob_lengths(traj: Trajectory) -> Defect | None:
    """Log-prob arrays without one entry per response token, or exact old logits without
    their values."""
    n = traj.num_response_tokens
    for name in ("logp_infer", "logp_old"):
        values = getattr(traj, name)
        if values is not None and len(values) != n:
            detail = f"{len(values)} {name} for {n} response tokens"
            return Defect(Reason.LENGTH_MISMATCH, name, detail)
    if traj.old_logits_status == OldLogitsStatus.EXACT and traj.logp_old is None:
        return Defect(Reason.MISSING_OLD_LOGITS, "logp_old", "status exact but no logp_old")
    return None


def _size(traj: Trajectory, limits: ValidationLimits) -> Defect | None:
    """A sequence longer than the model's context, or a token outside its vocabulary."""
    total = traj.num_prompt_tokens + traj.num_response_tokens
    if limits.max_total_tokens is not None and total > limits.max_total_tokens:
        detail = f"{total} tokens > {limits.max_total_tokens}"
        return Defect(Reason.TOO_LONG, "response_ids", detail)
    vocab = limits.vocab_size
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(traj, name)
        if len(ids) and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
            bound = ">= 0" if vocab is None else f"[0, {vocab})"
            return Defect(Reason.TOKEN_OUT_OF_RANGE, name, f"{name} outside {bound}")
    return None


def _nonfinite_logprobs(traj: Trajectory) -> Defect | None:
    """A NaN or infinite log-prob, which would poison the whole batch's loss."""
    for name in ("logp_infer", "logp_old"):
        values = getattr(traj, name)
        if values is not None and not np.isfinite(values).all():
            return Defect(Reason.NONFINITE_LOGPROB, name, name)
    return None


def _layout(traj: Trajectory) -> Defect | None:
    """Segments or turns that do not cover the response exactly."""
    n = traj.num_response_tokens
    if int(np.sum(traj.segment_lengths)) != n:
        detail = "segment lengths do not sum to the response length"
        return Defect(Reason.SEGMENT_MISMATCH, "segment_lengths", detail)
    lengths, kinds = traj.turn_lengths, traj.turn_kinds
    if lengths is None and kinds is None:
        return None
    if lengths is None or kinds is None:
        detail = "turn_lengths and turn_kinds must both be present"
        return Defect(Reason.TURN_MISMATCH, "turn_kinds", detail)
    if len(lengths) != len(kinds) or int(np.sum(lengths)) != n:
        return Defect(Reason.TURN_MISMATCH, "turn_lengths", "turns do not cover the response")
    if (lengths <= 0).any():
        return Defect(Reason.EMPTY_TURN, "turn_lengths", "a turn of no tokens")
    return None
