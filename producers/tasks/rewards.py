"""Reward functions as TRL calls them: a weighted list, scored a whole group at a time.

A reward function is named by dotted path and called once per group with keyword
arguments: ``prompts`` and ``completions`` (strings, or for a conversational row the
prompt's messages and ``[{"role": "assistant", "content": text}]``), ``completion_ids``,
and every other column of the prompt's row, one entry per completion. It returns one
float, or ``None`` where it does not apply, per completion. So a reward function written
for TRL's ``GRPOTrainer`` works unchanged, sync or ``async``.

A function runs under its own timeout: a sync one in a worker thread (the event loop,
which is generating other groups, never waits on it), an async one on the loop. What goes
wrong inside a function is contained: an exception, a timeout, a return that is not a
list of the group's length, or a value that is not a finite number gives that function no
value for the affected completions, and the sample carries the reason in its
``reward_details`` (``reward_errors``) and ``reward_failed``; the producer counts it
per function. A
thread whose function timed out cannot be killed and runs on to its end.

The record's reward is the weighted sum of the values present (a function with no value
for a completion adds nothing, as TRL's ``nansum``); each function's value is kept per
sample in ``reward_details["rewards"]``, which the trainer reports per step.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.objects import load_object

logger = logging.getLogger(__name__)

#: The arguments a reward function receives besides its row's columns.
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids")


class RewardFunctionConfig(BaseModel):
    """One reward function of a task's ``rewards`` list."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(description="Dotted path, 'package.module:function'.")
    weight: float = Field(default=1.0, allow_inf_nan=False, description="Its weight in the sum.")
    name: str = Field(
        default="",
        pattern=r"^([A-Za-z0-9_.-]{1,64})?$",
        description="The name its values are recorded and reported under (default: the "
        "function's own name).",
    )
    timeout_s: float = Field(default=30.0, gt=0, description="Seconds one group may take.")


class RewardError(Exception):
    """What a reward function did wrong, as recorded in a sample's ``reward_errors``."""


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function with its weight, name and timeout."""

    name: str
    weight: float
    timeout_s: float
    call: Callable[..., Any]

    @classmethod
    def load(cls, config: RewardFunctionConfig) -> RewardFunction:
        call = load_object(config.function)
        if not callable(call):
            raise ValueError(f"reward function {config.function!r} is not callable")
        name = config.name or getattr(call, "__name__", "") or config.function
        return cls(name, config.weight, config.timeout_s, call)

    async def values(self, arguments: Mapping[str, Any], size: int) -> list[float | None]:
        """One value per completion, or ``RewardError`` saying why there are none."""
        try:
            if inspect.iscoroutinefunction(self.call):
                result = await asyncio.wait_for(self.call(**arguments), self.timeout_s)
            else:
                result = await asyncio.wait_for(
                    asyncio.to_thread(self.call, **arguments), self.timeout_s
                )
                if inspect.isawaitable(result):  # a callable object with an async __call__
                    result = await asyncio.wait_for(result, self.timeout_s)
        except TimeoutError:
            raise RewardError(f"timed out after {self.timeout_s:g}s") from None
        except Exception as exc:  # the user's code: contained, never the producer's crash
            raise RewardError(f"raised {type(exc).__name__}: {exc}") from exc
        if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence):
            raise RewardError(
                f"returned {type(result).__name__}, not a list of {size} numbers or None"
            )
        if len(result) != size:
            raise RewardError(f"returned {len(result)} values for {size} completions")
        return list(result)


def checked_value(value: Any) -> float | None:
    """A function's value for one completion as a float, ``None`` when it has none; raises
    ``RewardError`` for anything else (a string, a bool, NaN, an infinity)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"value {value!r} is not a number or None")
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(f"value {number} is not finite")
    return number


@dataclass(frozen=True)
class Score:
    """One completion's reward and the details its record carries."""

    reward: float
    details: dict[str, Any]


class RewardSet:
    """A task's reward functions, scored together over each group."""

    def __init__(self, functions: Sequence[RewardFunction]) -> None:
        names = [f.name for f in functions]
        if not functions:
            raise ValueError("a reward list needs at least one function")
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must differ, got {names}: set 'name'")
        self.functions = list(functions)

    @classmethod
    def from_configs(cls, configs: Sequence[Mapping[str, Any] | RewardFunctionConfig]) -> RewardSet:
        """The set a task's ``rewards`` option names; a bad entry is a ``ValueError``."""
        if isinstance(configs, (str, Mapping)) or not isinstance(configs, Sequence):
            raise ValueError("'rewards' is a list of {function = ..., weight = ...} tables")
        loaded = []
        for index, entry in enumerate(configs):
            try:
                config = RewardFunctionConfig.model_validate(entry)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors()
                )
                raise ValueError(f"rewards[{index}]: {problems}") from None
            try:
                loaded.append(RewardFunction.load(config))
            except Exception as exc:  # the module or attribute is not there
                raise ValueError(f"rewards[{index}]: {exc}") from exc
        return cls(loaded)

    async def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]],
    ) -> list[Score]:
        """Every function over the group at once (concurrently), combined per completion."""
        size = len(completions)
        arguments = {
            **{k: list(v) for k, v in columns.items() if k not in RESERVED_ARGUMENTS},
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(ids) for ids in completion_ids],
        }
        outcomes = await asyncio.gather(
            *(f.values(arguments, size) for f in self.functions), return_exceptions=True
        )
        values: list[dict[str, float | None]] = [{} for _ in range(size)]
        errors: list[dict[str, str]] = [{} for _ in range(size)]
        for function, outcome in zip(self.functions, outcomes, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, RewardError):
                raise outcome  # cancellation: the group is being aborted
            for i in range(size):
                try:
                    if isinstance(outcome, RewardError):  # no values for the whole group
                        values[i][function.name] = None
                        errors[i][function.name] = str(outcome)
                    else:
                        values[i][function.name] = checked_value(outcome[i])
                except RewardError as exc:  # this completion's value is not a number
                    values[i][function.name] = None
                    errors[i][function.name] = str(exc)
            reasons = {errors[i][function.name] for i in range(size) if function.name in errors[i]}
            for reason in sorted(reasons):
                logger.warning("reward function %s: %s", function.name, reason)
        scores = []
        for i in range(size):
            reward = sum(
                f.weight * value for f in self.functions if (value := values[i][f.name]) is not None
            )
            details: dict[str, Any] = {"rewards": values[i], "reward_failed": bool(errors[i])}
            if errors[i]:
                details["reward_errors"] = errors[i]
            scores.append(Score(float(reward), details))
        return scores
