"""Hand-made scored groups for tests and benchmarks (no producer or stream needed).

``synthetic_groups`` samples responses from a model (or uniformly), records their
log-probs the way a generator and the old-logit service would (``logp_infer`` =
``logp_old`` = the model's log-probs in the shared layout, status ``exact``), scores them
with a toy reward (the share of response tokens equal to ``target_token``) and attaches
group-normalised advantages. Deterministic for a given seed.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.advantages import group_advantages
from schemas.group import SampleDiagnostics, ScoredGroup
from schemas.trajectory import OldLogitsStatus, Trajectory, TurnKind


@dataclass(frozen=True)
class GroupRecipe:
    """How ``synthetic_groups`` makes each group: ``group_size`` samples of one prompt of
    ``prompt_len`` tokens, responses of up to ``response_len`` tokens (exactly that many
    without ``vary_lengths``) below ``vocab_size``, sampled at ``version``; log-probs
    from ``model`` (uniform draws without one), old logits of ``status``."""

    group_size: int = 4
    prompt_len: int = 4
    response_len: int = 6
    vocab_size: int = 16
    version: int = 0
    model: Any = None
    seed: int = 0
    target_token: int = 5
    status: str = OldLogitsStatus.EXACT.value
    run_id: str = "test"
    region: str = "local"
    vary_lengths: bool = True


def synthetic_groups(num_groups: int, **recipe: Any) -> list[list[Trajectory]]:
    """``num_groups`` groups of ``group_size`` scored trajectories each; the keyword
    arguments are ``GroupRecipe``'s fields."""
    spec = GroupRecipe(**recipe)
    rng = np.random.default_rng(spec.seed)
    return [_synthetic_group(spec, rng, g) for g in range(num_groups)]


def _synthetic_group(spec: GroupRecipe, rng: np.random.Generator, g: int) -> list[Trajectory]:
    """Group number ``g``, drawn from ``rng``."""
    group_id = f"g{spec.seed}-{g}-{uuid.UUID(int=int(rng.integers(2**63))).hex[:8]}"
    prompt = rng.integers(1, spec.vocab_size, size=spec.prompt_len, dtype=np.int32)
    responses = []
    for _ in range(spec.group_size):
        length = (
            int(rng.integers(1, spec.response_len + 1)) if spec.vary_lengths else spec.response_len
        )
        responses.append(rng.integers(0, spec.vocab_size, size=length, dtype=np.int32))
    if spec.model is not None:
        from core.logprobs import response_logprobs

        logps = response_logprobs(spec.model, [(prompt, r) for r in responses])
    else:
        logps = [np.log(rng.uniform(0.05, 0.95, size=len(r))).astype(np.float32) for r in responses]
    rewards = [float(np.mean(r == spec.target_token)) for r in responses]
    if len(set(rewards)) == 1:  # keep a learning signal in every group
        rewards[0] += 1.0
    adv = group_advantages(rewards).advantages
    group = []
    for i, (resp, logp) in enumerate(zip(responses, logps, strict=True)):
        traj = Trajectory.create(
            run_id=spec.run_id,
            trajectory_id=f"{group_id}-{i}",
            group_id=group_id,
            group_size=spec.group_size,
            sample_index=i,
            producer_id="synthetic",
            region=spec.region,
            task="synthetic",
            prompt_ids=prompt,
            response_ids=resp,
            logp_infer=logp,
            segment_versions=[spec.version],
            segment_lengths=[len(resp)],
            reward=rewards[i],
            reward_details={},
            finish_reason="stop",
            created_at_ms=0,
            finished_at_ms=0,
        )
        if spec.status in (OldLogitsStatus.EXACT, OldLogitsStatus.APPROX):
            traj = traj.with_old_logits(logp, spec.status)
        elif spec.status != OldLogitsStatus.MISSING:
            traj = dataclasses.replace(traj, old_logits_status=spec.status)
        group.append(traj.with_advantage(float(adv[i])))
    return group


def scored_group(samples: list[Trajectory], *, trainer_version_seen: int = 0) -> ScoredGroup:
    """The ``rollouts.scored`` record of one synthetic group (``encode_group`` it)."""
    rewards = np.array([t.reward for t in samples], dtype=np.float64)
    first = samples[0]
    return ScoredGroup(
        run_id=first.run_id,
        group_id=first.group_id,
        group_size=first.group_size,
        trainer_version_seen=trainer_version_seen,
        samples=tuple(samples),
        diagnostics=tuple(
            SampleDiagnostics.of(t, trainer_version_seen - t.min_version) for t in samples
        ),
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        complete=len(samples) == first.group_size,
        emitted_at_ms=0,
    )


def episode(
    turns: list[tuple[int, int]], *, index: int = 0, end: str = "done", tools: int = 1
) -> Trajectory:
    """A scored multi-turn episode: ``turns`` as ``(TurnKind, length)`` pairs (policy
    tokens at log-prob -0.7, exact old logits), ``tools`` calls, ended by ``end``."""
    n = sum(length for _, length in turns)
    kinds = np.array([kind for kind, _ in turns], np.uint8)
    lengths = np.array([length for _, length in turns], np.int32)
    policy = np.repeat(kinds == TurnKind.POLICY, lengths)
    logp = np.where(policy, -0.7, 0.0).astype(np.float32)
    multi = len(turns) > 1
    return Trajectory.create(
        run_id="run",
        trajectory_id=f"t{index}",
        group_id="g",
        group_size=4,
        sample_index=index,
        producer_id="p",
        region="r",
        task="tools",
        prompt_ids=[1, 2, 3],
        response_ids=np.arange(n) % 7,
        logp_infer=logp,
        segment_versions=[5],
        segment_lengths=[n],
        reward=1.0,
        reward_details={},
        finish_reason="stop",
        created_at_ms=0,
        finished_at_ms=1,
        logp_old=logp,
        old_logits_status="exact",
        advantage=0.5,
        turn_lengths=lengths,
        turn_kinds=kinds,
        tool_calls=tools if multi else 0,
        episode_end=end if multi else "",
    )
