"""Data operators: a configured chain applied to each complete group before it is scored.

Contract: an operator is called with the group's samples (trajectories, sorted by sample
index, old logits attached) and returns either a ``Keep`` (the samples, unchanged or
changed: rewards may be reshaped, samples removed) or a ``Drop`` with a reason. Advantages
are never set by operators: ``build_scored_group`` recomputes them from the final rewards,
so an operator that changes rewards stays consistent with ``core.advantages``.

Built-ins are registered by name; a user operator is named by a dotted path
(``package.module:Class``) and built with its options as keyword arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from core.objects import load_object
from schemas.trajectory import FinishReason, Trajectory

OPERATOR_ERROR = "operator_error"


@dataclasses.dataclass(frozen=True, slots=True)
class Keep:
    samples: tuple[Trajectory, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Drop:
    reason: str


Decision = Keep | Drop


class Operator(Protocol):
    name: str

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision: ...


class OperatorError(RuntimeError):
    """An operator raised or broke its contract; the group is dead-lettered."""

    def __init__(self, operator: str, message: str) -> None:
        super().__init__(f"operator {operator!r}: {message}")
        self.operator = operator


def _with_reward(t: Trajectory, reward: float) -> Trajectory:
    return t if reward == t.reward else dataclasses.replace(t, reward=float(reward))


class ZeroVariance:
    """Dynamic sampling: a group whose rewards are all equal carries no gradient."""

    name = "zero_variance"

    def __init__(self, atol: float = 0.0) -> None:
        if atol < 0:
            raise ValueError("atol must be >= 0")
        self.atol = float(atol)

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision:
        rewards = [t.reward for t in samples]
        if len(rewards) < 2 or max(rewards) - min(rewards) <= self.atol:
            return Drop("zero_variance")
        return Keep(samples)


class Overlong:
    """Samples cut at the length limit: removed (``filter``) or given ``penalty`` reward."""

    name = "overlong"

    def __init__(self, mode: str = "filter", penalty: float = 0.0) -> None:
        if mode not in ("filter", "penalise"):
            raise ValueError(f"mode must be 'filter' or 'penalise', got {mode!r}")
        self.mode, self.penalty = mode, float(penalty)

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision:
        long = [t.finish_reason == FinishReason.LENGTH for t in samples]
        if self.mode == "penalise":
            return Keep(
                tuple(
                    _with_reward(t, self.penalty) if x else t
                    for t, x in zip(samples, long, strict=True)
                )
            )
        kept = tuple(t for t, x in zip(samples, long, strict=True) if not x)
        return Keep(kept) if kept else Drop("overlong")


class LengthPenalty:
    """Reward minus ``coef`` per response token beyond ``free_tokens``."""

    name = "length_penalty"

    def __init__(self, coef: float = 0.001, free_tokens: int = 0) -> None:
        if coef < 0 or free_tokens < 0:
            raise ValueError("coef and free_tokens must be >= 0")
        self.coef, self.free = float(coef), int(free_tokens)

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision:
        return Keep(
            tuple(
                _with_reward(t, t.reward - self.coef * max(0, len(t.response_ids) - self.free))
                for t in samples
            )
        )


class DuplicateResponses:
    """Identical responses in a group are kept once (the first by sample index)."""

    name = "duplicate_responses"

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision:
        seen: set[bytes] = set()
        kept = []
        for t in samples:
            key = t.response_ids.tobytes()
            if key not in seen:
                seen.add(key)
                kept.append(t)
        return Keep(tuple(kept))


class RewardClip:
    """Rewards clipped into ``[low, high]``."""

    name = "reward_clip"

    def __init__(self, low: float = -1.0, high: float = 1.0) -> None:
        if low > high:
            raise ValueError(f"low {low} > high {high}")
        self.low, self.high = float(low), float(high)

    def __call__(self, samples: tuple[Trajectory, ...]) -> Decision:
        return Keep(
            tuple(_with_reward(t, min(self.high, max(self.low, t.reward))) for t in samples)
        )


BUILTINS: Mapping[str, Callable[..., Operator]] = {
    cls.name: cls for cls in (ZeroVariance, Overlong, LengthPenalty, DuplicateResponses, RewardClip)
}


def build_operator(name: str, options: Mapping[str, Any] | None = None) -> Operator:
    """A built-in by name, or a user operator by dotted path; bad config raises ValueError."""
    opts = dict(options or {})
    try:
        factory = BUILTINS[name] if name in BUILTINS else load_object(name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"unknown stream operator {name!r}: {exc}") from exc
    try:
        op = factory(**opts)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"stream operator {name!r}: bad options {opts}: {exc}") from exc
    if not callable(op):
        raise ValueError(f"stream operator {name!r} built a non-callable {type(op).__name__}")
    if not isinstance(getattr(op, "name", None), str):
        try:
            op.name = name  # type: ignore[misc]
        except AttributeError as exc:
            raise ValueError(f"stream operator {name!r} has no str 'name'") from exc
    return op


def build_chain(specs: Sequence[Mapping[str, Any]]) -> tuple[Operator, ...]:
    """Operators from ``[{name, options}]`` config entries, in order."""
    chain = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ValueError(f"streams.operators[{i}] needs a 'name' string, got {spec!r}")
        unknown = set(spec) - {"name", "options"}
        if unknown:
            raise ValueError(f"streams.operators[{i}]: unknown keys {sorted(unknown)}")
        chain.append(build_operator(spec["name"], spec.get("options")))
    return tuple(chain)


@dataclasses.dataclass(frozen=True, slots=True)
class ChainResult:
    """What a chain decided for one group.

    ``decision``: the group to score (``Keep``) or why it is filtered (``Drop``, reason
    ``operator:reason``). ``trace``: each operator's decision in order (``kept``,
    ``changed``, or its drop reason). ``removed``: samples an operator took out of a kept
    group, with the operator's name; they are filtered too, never dropped silently.
    """

    decision: Decision
    trace: tuple[tuple[str, str], ...]
    removed: tuple[tuple[str, Trajectory], ...]

    @property
    def dropped_by(self) -> str | None:
        """The operator that filtered the whole group, if one did."""
        return self.trace[-1][0] if isinstance(self.decision, Drop) else None


def apply_chain(chain: Sequence[Operator], samples: Sequence[Trajectory]) -> ChainResult:
    """Run ``samples`` through ``chain`` (see ``ChainResult``).

    Raises ``OperatorError`` when an operator raises or returns something else than
    ``Keep``/``Drop`` (or a ``Keep`` holding something else than the group's samples).
    """
    current = tuple(samples)
    trace: list[tuple[str, str]] = []
    removed: list[tuple[str, Trajectory]] = []
    for op in chain:
        name = op.name
        try:
            out = op(current)
        except Exception as exc:
            raise OperatorError(name, f"raised {type(exc).__name__}: {exc}") from exc
        if isinstance(out, Drop) and isinstance(out.reason, str) and out.reason:
            trace.append((name, out.reason))
            return ChainResult(out, tuple(trace), tuple(removed))
        if not isinstance(out, Keep) or not all(isinstance(t, Trajectory) for t in out.samples):
            raise OperatorError(name, f"returned {type(out).__name__}, not Keep or Drop")
        known = {t.trajectory_id for t in current}
        if any(t.trajectory_id not in known for t in out.samples):
            raise OperatorError(name, "returned samples that were not in the group")
        if len({t.trajectory_id for t in out.samples}) != len(out.samples):
            raise OperatorError(name, "returned a sample twice")
        kept_ids = {t.trajectory_id for t in out.samples}
        taken = [t for t in current if t.trajectory_id not in kept_ids]
        changed = bool(taken) or any(a is not b for a, b in zip(out.samples, current, strict=False))
        if not out.samples:
            trace.append((name, "empty"))
            return ChainResult(Drop("empty"), tuple(trace), tuple(removed))
        removed.extend((name, t) for t in taken)
        current = tuple(out.samples)
        trace.append((name, "changed" if changed else "kept"))
    return ChainResult(Keep(current), tuple(trace), tuple(removed))
