"""Environments that misbehave in every way a tool can, named by dotted path
(``support.envs:factory``) as a user's environment would be."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from core.models import BOS_ID, EOS_ID, SEP_ID
from producers.tasks.base import Prompt, TaskContext
from producers.tasks.environments import EpisodeLimits, MalformedToolCall, Observation


@dataclass
class BrokenEpisode:
    """Answers the first turn well (one feedback token), then fails as ``how`` says."""

    how: str
    turns: int = 0

    async def step(self, turn_ids: list[int]) -> Any:
        self.turns += 1
        if self.turns == 1:
            return Observation(ids=[SEP_ID], tool_call=True)
        match self.how:
            case "raise":
                raise RuntimeError("the tool crashed")
            case "hang":
                await asyncio.sleep(3600)
            case "flood":
                return Observation(ids=[SEP_ID] * 100_000, tool_call=True)
            case "malformed":
                raise MalformedToolCall("no closing tag")
            case "bad_ids":
                return Observation(ids=[SEP_ID, -3, 10**9])
            case "text_ids":
                return Observation(ids=["4", 1.5])  # type: ignore[list-item]
            case "not_an_observation":
                return {"ids": [SEP_ID]}
            case "nan_reward":
                return Observation(reward=float("nan"))
            case "never_done":
                return Observation(ids=[SEP_ID])
        raise AssertionError(self.how)

    def reward(self) -> tuple[float, dict[str, Any]]:
        if self.how == "bad_reward":
            raise ValueError("cannot score")
        if self.how == "bad_details":
            return 1.0, {"object": object()}
        return 0.5, {"turns_seen": self.turns}


@dataclass
class BrokenEnvironment:
    how: str
    name: str = "broken"
    max_new_tokens: int = 3
    stop_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])
    limits: EpisodeLimits = field(
        default_factory=lambda: EpisodeLimits(max_turns=4, tool_timeout_s=0.2)
    )

    def sample(self, rng: random.Random) -> Prompt:
        return Prompt([BOS_ID, 5, SEP_ID])

    def start(self, prompt: Prompt) -> BrokenEpisode:
        return BrokenEpisode(self.how)

    def encode(self, text: str) -> list[int]:
        raise MalformedToolCall("token ids only")

    def reward(self, prompt: Prompt, response_ids: list[int]) -> tuple[float, dict]:
        raise TypeError("scored per episode")


def broken(context: TaskContext, how: str = "raise") -> BrokenEnvironment:
    return BrokenEnvironment(how)
