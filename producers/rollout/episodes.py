"""Runs one multi-turn episode: policy turns through the engine, observations from the
environment, every limit enforced, every way a tool can fail turned into a reason.

The runner knows nothing about Kafka or weights: the worker hands it ``generate_turn``,
which runs one policy turn through its engine client under the version policy in force
(a weight update mid-turn interrupts, finishes or aborts that turn as for a single-turn
sample) and returns the turn's tokens, log-probs and version segments. The episode's
response is the concatenation of its turns; environment tokens get log-prob 0.0 and
belong to the version segment of the policy token before them (``schemas.trajectory``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import operator
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from producers.engine.client import EngineUnavailable
from producers.tasks.base import Prompt
from producers.tasks.environments import Environment, EpisodeLimits, MalformedToolCall, Observation
from producers.tasks.peers import PeerSample
from schemas.trajectory import EpisodeEnd, TurnKind

logger = logging.getLogger(__name__)

PEER_NAME = re.compile(r"^([a-z][a-z0-9_-]{0,31})?$")
"""An observation's ``policy``: empty (the environment) or a policy name."""


class PolicyTurn(Protocol):
    """What ``generate_turn`` returns (the worker's ``Sample``)."""

    response_ids: list[int]
    logprobs: list[float]
    segments: list[list[int]]  # [version, length], versions non-decreasing
    finish_type: str
    interruptions: int


GenerateTurn = Callable[[list[int], int, int], Awaitable[PolicyTurn]]
"""``(history ids, max_new_tokens, turn index) -> the policy's turn``."""


@dataclass
class EpisodeResult:
    """Everything a trajectory record needs from one episode."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    turn_lengths: list[int] = field(default_factory=list)
    turn_kinds: list[int] = field(default_factory=list)
    finish_type: str = "stop"
    interruptions: int = 0
    tool_calls: int = 0
    end: EpisodeEnd = EpisodeEnd.DONE
    end_detail: str = ""
    reward: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    # Multi-policy episodes: who produced each turn ("" for this policy's own turns and
    # for the environment; a peer policy's name for an observation a peer generated),
    # and the peers' turns to publish as their own policies' records.
    turn_sources: list[str] = field(default_factory=list)
    peer_samples: list[PeerSample] = field(default_factory=list)

    def add_policy_turn(self, turn: PolicyTurn) -> None:
        self.response_ids += turn.response_ids
        self.logprobs += turn.logprobs
        for version, length in turn.segments:
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += length
            else:
                self.segments.append([version, length])
        self.turn_lengths.append(len(turn.response_ids))
        self.turn_kinds.append(TurnKind.POLICY)
        self.turn_sources.append("")
        self.finish_type = turn.finish_type
        self.interruptions += turn.interruptions

    def trajectory_fields(self, policy: str = "") -> dict[str, Any]:
        """What the episode fills of its record (``Trajectory.create`` keywords); the
        caller adds the ids, timestamps and ``reward_details``. ``policy``: the record's
        policy, named for its own turns when a peer's turn needs naming too."""
        sources = None
        if any(self.turn_sources):
            sources = [
                policy if kind == TurnKind.POLICY else source
                for kind, source in zip(self.turn_kinds, self.turn_sources, strict=True)
            ]
        return {
            "turn_policies": sources,
            "response_ids": self.response_ids,
            "logp_infer": self.logprobs,
            "segment_versions": [v for v, _ in self.segments],
            "segment_lengths": [n for _, n in self.segments],
            "turn_lengths": self.turn_lengths,
            "turn_kinds": self.turn_kinds,
            "tool_calls": self.tool_calls,
            "episode_end": self.end,
            "reward": float(self.reward),
            "finish_reason": self.finish_type,
        }

    def add_env_turn(self, ids: list[int], source: str = "") -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.segments[-1][1] += len(ids)  # the version of the policy token before them
        self.turn_lengths.append(len(ids))
        self.turn_kinds.append(TurnKind.ENV)
        self.turn_sources.append(source)


class EpisodeRunner:
    """Plays one episode of ``env`` from ``prompt`` within ``limits``."""

    def __init__(self, env: Environment, limits: EpisodeLimits, vocab_size: int | None) -> None:
        self.env = env
        self.limits = limits
        self.vocab_size = vocab_size

    async def run(self, prompt: Prompt, generate_turn: GenerateTurn) -> EpisodeResult:
        limits = self.limits
        result = EpisodeResult()
        episode = self.env.start(prompt)
        rewards = 0.0
        started = time.monotonic()
        turn = 0
        while True:
            if turn >= limits.max_turns:
                result.end = EpisodeEnd.MAX_TURNS
                break
            room = limits.max_total_tokens - len(result.response_ids)
            if room <= 0:
                result.end = EpisodeEnd.MAX_TOKENS
                break
            if time.monotonic() - started > limits.episode_timeout_s:
                result.end = EpisodeEnd.EPISODE_TIMEOUT
                break
            history = list(prompt.ids) + result.response_ids
            policy = await generate_turn(history, min(self.env.max_new_tokens, room), turn)
            turn += 1
            if not policy.response_ids:
                result.end, result.end_detail = EpisodeEnd.DONE, "empty policy turn"
                break
            result.add_policy_turn(policy)
            observation, failure = await self._observe(episode, list(policy.response_ids))
            if failure is not None:
                result.end, result.end_detail = failure
                break
            assert observation is not None
            rewards += observation.reward
            result.tool_calls += int(observation.tool_call)
            if observation.done:
                result.end = EpisodeEnd.DONE
                break
            ids, failure = self._observation_ids(observation)
            if failure is not None:
                result.end, result.end_detail = failure
                break
            if len(result.response_ids) + len(ids) >= limits.max_total_tokens:
                result.end = EpisodeEnd.MAX_TOKENS  # no room left for another policy turn
                break
            if ids:
                result.add_env_turn(ids, observation.policy)
        final, details = self._final_reward(episode)
        result.reward = final + rewards
        result.details = {
            **details,
            "turns": result.turn_kinds.count(TurnKind.POLICY),
            "episode_end": result.end.value,
        }
        if result.end_detail:
            result.details["episode_end_detail"] = result.end_detail[:500]
        result.peer_samples = self._peer_samples(episode, result)
        return result

    async def _observe(
        self, episode: Any, turn_ids: list[int]
    ) -> tuple[Observation | None, tuple[EpisodeEnd, str] | None]:
        """The environment's answer, or why there is none (its own exceptions included:
        a broken tool ends the episode, never the worker)."""
        try:
            answer = await asyncio.wait_for(episode.step(turn_ids), self.limits.tool_timeout_s)
        except MalformedToolCall as exc:
            return None, (EpisodeEnd.MALFORMED_TOOL_CALL, str(exc))
        except EngineUnavailable:
            raise  # a peer policy's engine is away: the group is generated again, not scored
        except TimeoutError:
            return None, (
                EpisodeEnd.TOOL_TIMEOUT,
                f"no observation within {self.limits.tool_timeout_s:g}s",
            )
        except Exception as exc:
            logger.warning("environment %s raised: %r", self.env.name, exc)
            return None, (EpisodeEnd.TOOL_EXCEPTION, f"{type(exc).__name__}: {exc}")
        if not isinstance(answer, Observation):
            return None, (
                EpisodeEnd.TOOL_EXCEPTION,
                f"step returned {type(answer).__name__}, not an Observation",
            )
        if not isinstance(answer.reward, int | float) or not math.isfinite(answer.reward):
            return None, (EpisodeEnd.TOOL_EXCEPTION, f"observation reward {answer.reward!r}")
        return answer, None

    def _observation_ids(
        self, observation: Observation
    ) -> tuple[list[int], tuple[EpisodeEnd, str] | None]:
        """The observation as token ids within the limits, or why it cannot be one."""
        try:
            if observation.text is not None:
                ids = list(self.env.encode(observation.text))
            else:
                ids = list(observation.ids)
        except MalformedToolCall as exc:
            return [], (EpisodeEnd.MALFORMED_TOOL_CALL, str(exc))
        except Exception as exc:
            return [], (EpisodeEnd.TOOL_EXCEPTION, f"encoding the observation: {exc!r}")
        if not isinstance(observation.policy, str) or not PEER_NAME.match(observation.policy):
            return [], (
                EpisodeEnd.TOOL_EXCEPTION,
                f"observation policy {observation.policy!r} is not a policy name",
            )
        limit = self.limits.max_observation_tokens
        if len(ids) > limit:
            return [], (
                EpisodeEnd.OBSERVATION_TOO_LARGE,
                f"{len(ids)} observation tokens, limit {limit}",
            )
        try:
            ids = [operator.index(t) for t in ids]  # ints, numpy ints; never floats or text
        except TypeError as exc:
            return [], (EpisodeEnd.TOOL_EXCEPTION, f"observation token ids: {exc}")
        top = self.vocab_size
        bad = [t for t in ids if t < 0 or (top is not None and t >= top)]
        if bad:
            return [], (EpisodeEnd.TOOL_EXCEPTION, f"observation token ids {bad[:5]} invalid")
        return ids, None

    def _peer_samples(self, episode: Any, result: EpisodeResult) -> list[PeerSample]:
        """The peers' turns the episode hands back (``Episode.peer_samples``, optional):
        anything that is not a ``PeerSample`` with a finite reward is left out and said
        in the episode's details, never published."""
        collect = getattr(episode, "peer_samples", None)
        if collect is None:
            return []
        try:
            given = list(collect())
        except Exception as exc:
            logger.warning("environment %s failed to give its peer samples: %r", self.env.name, exc)
            result.details["peer_error"] = repr(exc)[:500]
            return []
        good = [
            s
            for s in given
            if isinstance(s, PeerSample)
            and isinstance(s.reward, int | float)
            and math.isfinite(s.reward)
        ]
        if len(good) < len(given):
            result.details["peer_error"] = f"{len(given) - len(good)} malformed peer sample(s)"
        return good

    def _final_reward(self, episode: Any) -> tuple[float, dict[str, Any]]:
        try:
            reward, details = episode.reward()
            reward = float(reward)
        except Exception as exc:
            logger.warning("environment %s failed to score an episode: %r", self.env.name, exc)
            return 0.0, {"reward_error": repr(exc)[:500]}
        if not math.isfinite(reward):
            return 0.0, {"reward_error": f"non-finite reward {reward!r}"}
        try:
            details = orjson.loads(orjson.dumps(details))  # travels as JSON in the record
        except (TypeError, orjson.JSONEncodeError) as exc:
            return reward, {"details_error": f"reward details are not JSON: {exc}"[:500]}
        if not isinstance(details, dict):
            return reward, {"details_error": "reward details are not an object"}
        return reward, details
