"""Environments: multi-turn, tool-using episodes (agentic RL).

An environment is a task (``producers.tasks.base``: a prompt source, registered by name or
dotted path the same way) that also starts episodes. An episode alternates turns: the
policy generates (one ``/generate`` with the whole history, so any SGLang server works),
the environment answers with an **observation** (token ids or text: a tool's result, a
user's reply, a feedback token) that is appended to the history, conditioned on by later
turns and never trained, until the environment says ``done`` or a limit is reached.

The contract (``Environment``, ``Episode``) is async so a tool may wait on I/O without
blocking the worker; a tool doing blocking work should run it in a thread
(``asyncio.to_thread``). ``EpisodeRunner`` in ``producers.rollout.worker`` enforces the limits
(``EpisodeLimits``) around it: per episode (policy turns, total tokens, wall time) and
per tool call (time, observation size). A tool that raises, hangs, floods or cannot parse
the policy's call ends the episode with that reason (``schemas.trajectory.EpisodeEnd``)
recorded in the published record; the worker never dies for it and nothing is dropped.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.models import BOS_ID, EOS_ID, SEP_ID
from producers.tasks.base import (
    Prompt,
    Task,
    TaskContext,
    chat_stop_ids,
    digits_to_ids,
    hf_tokenizer,
    register_task,
    score_arithmetic,
    score_digits,
    word_problem_prompt,
)


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode and of each tool call; the environment's defaults, which
    ``[producers.rollout.episode]`` may override."""

    max_turns: int = 4  # policy turns
    max_total_tokens: int = 1024  # response tokens: policy and environment turns together
    episode_timeout_s: float = 120.0  # checked between turns: a turn in flight finishes
    tool_timeout_s: float = 10.0  # one ``Episode.step``
    max_observation_tokens: int = 256


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one policy turn.

    ``ids`` (or ``text``, tokenized with the environment's ``encode``) are appended to
    the history as an environment turn, unless the episode is ``done``. ``reward`` is
    added to the episode's final reward; ``tool_call`` counts a tool invocation.
    """

    ids: Sequence[int] = ()
    text: str | None = None
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    policy: str = ""  # a peer policy that generated these tokens ("" = the environment)


class MalformedToolCall(ValueError):
    """The policy's turn asked for a tool in a form the environment cannot parse."""


class Episode(Protocol):
    """One episode's state, from ``Environment.start``."""

    async def step(self, turn_ids: list[int]) -> Observation:
        """Take the policy's turn (its token ids); answer with an observation."""
        ...

    def reward(self) -> tuple[float, dict[str, Any]]:
        """The final reward (observation rewards are added to it) and its details."""
        ...


class Environment(Task, Protocol):
    """A task whose prompts start multi-turn episodes. ``max_new_tokens`` and
    ``stop_token_ids`` apply to each policy turn; ``Task.reward`` is not used."""

    limits: EpisodeLimits
    # Optional: ``stop: list[str]``, strings that end a policy turn (SGLang's ``stop``;
    # e.g. the end of a tool call, so the tool answers before the policy goes on).

    def start(self, prompt: Prompt) -> Episode: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of a text observation."""
        ...


def is_environment(task: Task) -> bool:
    return callable(getattr(task, "start", None)) and hasattr(task, "limits")


# --- echo-digits: the multi-turn workhorse for the tiny model --------------------------------


@dataclass
class EchoEpisode:
    """Every turn the environment says a digit; the policy must repeat it and stop."""

    digits: list[int]
    scores: list[float] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)

    async def step(self, turn_ids: list[int]) -> Observation:
        turn = len(self.scores)
        score, details = score_digits([self.digits[turn]], turn_ids)
        self.scores.append(score)
        self.details.append(details)
        if turn + 1 == len(self.digits):
            return Observation(done=True)
        return Observation(ids=[*digits_to_ids([self.digits[turn + 1]]), SEP_ID])

    def reward(self) -> tuple[float, dict[str, Any]]:
        turns = len(self.digits)
        correct = sum(bool(d["correct"]) for d in self.details)
        return sum(self.scores) / turns, {
            "turns": turns,
            "turns_answered": len(self.scores),
            "turns_correct": correct,
            "correct": correct == turns,
            "format_ok": all(d["format_ok"] for d in self.details) and len(self.details) == turns,
        }


@dataclass
class EchoDigits:
    """``BOS d1 SEP`` → policy ``d1 EOS`` → env ``d2 SEP`` → policy ``d2 EOS`` → …

    Reward: the mean over turns of ``score_digits`` (partial credit per position), so an
    episode cut short by a limit scores the turns it never answered as 0. A random tiny
    model learns it in a few minutes on 2 cores; its environment tokens carry the
    information the next turn needs, so a trainer that trained on them, or a stream that
    mis-scored them, shows up in the curve.
    """

    name: str = "echo-digits"
    turns: int = 3
    max_new_tokens: int = 3
    stop_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])
    limits: EpisodeLimits = field(
        default_factory=lambda: EpisodeLimits(max_turns=8, max_total_tokens=64)
    )

    def sample(self, rng: random.Random) -> Prompt:
        digits = [rng.randrange(10) for _ in range(self.turns)]
        return Prompt([BOS_ID, *digits_to_ids(digits[:1]), SEP_ID], {"digits": digits})

    def start(self, prompt: Prompt) -> EchoEpisode:
        return EchoEpisode(list(prompt.meta["digits"]))

    def encode(self, text: str) -> list[int]:
        raise MalformedToolCall("echo-digits answers with token ids, never text")

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        raise TypeError("echo-digits is scored per episode (Episode.reward)")


@register_task("echo-digits", forwards=EchoDigits)
def echo_digits(context: TaskContext, turns: int = 3, **kw: Any) -> EchoDigits:
    if turns < 1:
        raise ValueError(f"echo-digits needs at least one turn, got {turns}")
    return EchoDigits(turns=turns, **kw)


# --- a calculator tool for SmolLM2 on arithmetic word problems -----------------------------

CALC_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
CALC_OPEN = "<calc>"
CALCULATOR_PROMPT = (
    "You are a careful math assistant with a calculator. To use it, write "
    "<calc>expression</calc> (numbers, + - * / and parentheses); the result comes back as "
    "<result>value</result>. When you know the answer, end with 'Answer: <number>'.\n"
    "Example. Question: A box holds 12 pens. How many pens are in 7 boxes?\n"
    "You: <calc>12*7</calc>\n<result>84</result>\nAnswer: 84"
)

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_EXPRESSION_CHARS = 120
MAX_MAGNITUDE = 10**12


def evaluate_expression(text: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // %, unary minus and
    parentheses, parsed with ``ast`` and walked by hand (never ``eval``); anything else,
    a division by zero or a value (a literal or a result) beyond 1e12 raises
    ``MalformedToolCall``."""
    text = text.strip().replace(",", "")
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise MalformedToolCall(f"expression of {len(text)} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise MalformedToolCall(f"not an expression: {text!r}") from exc

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            # a literal too: ``1e999`` parses as inf, and inf - inf is nan
            if not abs(node.value) <= MAX_MAGNITUDE:
                raise MalformedToolCall("value out of range")
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise MalformedToolCall("division by zero")
            value = _OPERATORS[type(node.op)](left, right)
            if abs(value) > MAX_MAGNITUDE:
                raise MalformedToolCall("value out of range")
            return value
        raise MalformedToolCall(f"unsupported syntax {type(node).__name__} in {text!r}")

    return walk(tree)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6)) if isinstance(value, float) else str(value)


@dataclass
class CalculatorEpisode:
    """Answers each ``<calc>…</calc>`` with ``<result>…</result>``; done at ``Answer:``."""

    answer: int
    decode: Callable[[list[int]], str]
    text: list[str] = field(default_factory=list)
    calls: int = 0

    async def step(self, turn_ids: list[int]) -> Observation:
        turn = self.decode(turn_ids)
        self.text.append(turn)
        call = CALC_CALL.search(turn)
        if call is None:
            if CALC_OPEN in turn:
                raise MalformedToolCall("a <calc> call without its closing </calc>")
            return Observation(done=True)  # a final answer (or none): scored at the end
        self.calls += 1
        value = format_number(evaluate_expression(call.group(1)))
        return Observation(text=f"<result>{value}</result>\n", tool_call=True)

    def reward(self) -> tuple[float, dict[str, Any]]:
        reward, details = score_arithmetic(self.text[-1] if self.text else "", self.answer)
        return reward, {**details, "calculator_calls": self.calls}


@dataclass
class CalculatorArithmetic:
    """Arithmetic word problems for SmolLM2-135M-Instruct, with a calculator tool."""

    tokenizer: Any
    name: str = "arithmetic-calculator"
    max_new_tokens: int = 96
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=lambda: ["</calc>"])  # the tool answers here
    limits: EpisodeLimits = field(
        default_factory=lambda: EpisodeLimits(max_turns=4, max_total_tokens=512)
    )

    def __post_init__(self) -> None:
        if not self.stop_token_ids:
            self.stop_token_ids = chat_stop_ids(self.tokenizer)

    def sample(self, rng: random.Random) -> Prompt:
        return word_problem_prompt(self.tokenizer, CALCULATOR_PROMPT, rng)

    def start(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(
            int(prompt.meta["answer"]),
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        raise TypeError("arithmetic-calculator is scored per episode (Episode.reward)")


@register_task("arithmetic-calculator", forwards=CalculatorArithmetic)
def arithmetic_calculator(
    context: TaskContext, tokenizer: str | None = None, **kw: Any
) -> CalculatorArithmetic:
    return CalculatorArithmetic(hf_tokenizer(context, tokenizer), **kw)
