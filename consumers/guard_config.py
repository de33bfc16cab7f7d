"""``[trainer.guards]``: the stability guards' settings (``consumers.guards`` says what each
guard watches and does). Pydantic only, so a dry run validates them without numpy/torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import StrictModel

#: Exit status of a trainer a guard stopped: ``rollstream up`` does not restart it (a
#: restart would resume into the same state and trip again).
GUARD_EXIT = 3

Action = Literal["warn", "pause", "stop", "rollback"]
ACTION_ORDER: dict[str, int] = {"warn": 0, "pause": 1, "rollback": 2, "stop": 3}
GUARD_NAMES = ("entropy", "mismatch", "flat_rewards", "non_finite")


class GuardBase(StrictModel):
    """What every guard has: how long the signal must be abnormal, and what to do."""

    action: Action = Field(
        default="warn",
        description="warn (log + metric), pause (producers start no new group until the "
        "signal is normal again), stop (checkpoint and exit naming the guard), rollback "
        "(resume from the last healthy checkpoint, [trainer.guards.rollback]).",
    )
    steps: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Consecutive measured steps the signal must be abnormal to trip.",
    )


class EntropyGuard(GuardBase):
    """Policy entropy below a floor: the policy is becoming deterministic."""

    floor: float | None = Field(
        default=None,
        ge=0,
        description="Trip below this mean entropy (nats) of the trained tokens under the "
        "policy being trained. Empty: off (a sane floor depends on the task's vocabulary "
        "and answer length).",
    )


class MismatchGuard(GuardBase):
    """Train/inference mismatch above a bound: the engine's numerics drifted from the
    trainer's (a wrong dtype, a stale kernel), so the correction weights lose meaning."""

    metric: Literal["k3", "abs_log_d"] = Field(
        default="k3",
        description="k3: mean over exact records' tokens of exp(x) - 1 - x, x = logp_old - "
        "logp_infer (the same as mismatch/k3_kl); abs_log_d: mean |x|.",
    )
    bound: float | None = Field(
        default=None,
        gt=0,
        description="Trip above this value. Empty: off (the mismatch a run lives with "
        "depends on its engine and trainer dtypes: docs/learning.md measures it).",
    )


class FlatRewardsGuard(GuardBase):
    """Every group of a batch with zero reward variance: every advantage is zero, so no
    gradient can move the policy (a solved task looks the same: set ``steps`` with care)."""

    steps: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Trip after this many consecutive batches in which every group's "
        "rewards are all equal. 0: off.",
    )


class NonFiniteGuard(GuardBase):
    """A NaN or infinite reward or gradient norm: the weights are or will be garbage."""

    action: Action = Field(
        default="stop",
        description="On by default with stop: no run is healthy after a non-finite "
        "gradient norm. warn, pause, stop or rollback.",
    )
    enabled: bool = Field(default=True, description="false: measured, never acted on.")


class RollbackConfig(StrictModel):
    """How a ``rollback`` action resumes."""

    max: int = Field(
        default=2,
        ge=0,
        le=100,
        description="Most rollbacks in a run (over restarts); one more trip stops the run.",
    )
    lr_factor: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="The peak learning rate is multiplied by this at every rollback "
        "(0.5 twice: a quarter of [trainer.engine] lr).",
    )
    reseed: bool = Field(
        default=True,
        description="Move the trainer's seed (torch and the PPO shuffle) by one per rollback, "
        "so the run does not walk the same path into the same trap.",
    )


class GuardsConfig(StrictModel):
    """``[trainer.guards]``: one sub-table per guard, and ``[trainer.guards.rollback]``."""

    entropy: EntropyGuard = Field(default_factory=EntropyGuard, description="Entropy floor.")
    mismatch: MismatchGuard = Field(
        default_factory=MismatchGuard, description="Train/infer mismatch bound."
    )
    flat_rewards: FlatRewardsGuard = Field(
        default_factory=FlatRewardsGuard, description="Zero reward variance in every group."
    )
    non_finite: NonFiniteGuard = Field(
        default_factory=NonFiniteGuard, description="Non-finite reward or gradient norm."
    )
    rollback: RollbackConfig = Field(
        default_factory=RollbackConfig, description="What a rollback action does."
    )

    def enabled(self) -> dict[str, GuardBase]:
        """The guards that act, by name."""
        out: dict[str, GuardBase] = {}
        if self.entropy.floor is not None:
            out["entropy"] = self.entropy
        if self.mismatch.bound is not None:
            out["mismatch"] = self.mismatch
        if self.flat_rewards.steps > 0:
            out["flat_rewards"] = self.flat_rewards
        if self.non_finite.enabled:
            out["non_finite"] = self.non_finite
        return out

    def rolls_back(self) -> bool:
        return any(g.action == "rollback" for g in self.enabled().values())
