"""Tasks: where prompts come from and how responses are scored.

A task is a prompt source plus a reward function (``Task``). The registry maps names to
factories; ``producers.tasks.catalog.make_task(name, options, context)`` builds one. Built in:

- ``copy-first-digit-twice`` and ``reverse-3-digits``: synthetic tasks for the tiny model
  (``core.models``: vocab PAD BOS EOS SEP ``+`` 0-9). Prompt ``BOS d1 d2 d3 SEP``; the target
  is the answer digits followed by EOS. Reward is partial credit: the share of target
  positions (EOS included) the response gets right, so 1.0 means an exact answer that
  stops where it should. A randomly initialised model learns the first in ~100 GRPO steps
  on one core.
- ``repeat-digit``: ``BOS d SEP`` → ``d`` written ``2d + 1`` times: responses of 2 to 20
  tokens (a long tail, for the staleness length-bias measurements).
- ``arithmetic``: word problems with integer answers for SmolLM2-135M-Instruct, generated
  from templates with a seeded RNG (no dataset download), checked exactly. The model is
  asked to end with ``Answer: <number>``; ``format_ok`` tells whether it did. By default
  one-step problems after one worked example, with a format reward (``ArithmeticTask``).
- ``file`` (``producers.tasks.file``): your own prompts from a data file, scored by your
  reward functions.

Register more with ``@register_task("name")`` on a factory ``(context, **options) -> Task``,
or name a factory directly as ``"package.module:factory"``. Reward details (parsed answer,
correctness, format) are a small JSON object that travels in the trajectory's
``reward_details``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core.models import (
    BOS_ID,
    DIGIT0_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    SMOLLM2,
    TINY_VOCAB,
    load_tokenizer,
)
from core.objects import load_object  # re-exported: one loader for user objects

# --- the tiny vocabulary ------------------------------------------------------------------


def digits_to_ids(digits: Sequence[int]) -> list[int]:
    return [DIGIT0_ID + d for d in digits]


# --- the task contract -------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and what its reward function needs (``meta``)."""

    ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    text: str | None = None


class Task(Protocol):
    """A prompt source and a reward function.

    A task may score whole groups instead, with ``async score_group(prompt, responses)
    -> list[producers.tasks.rewards.Score]`` (the file task's TRL-style reward functions do);
    the producer uses it where a task has it, and then ``reward`` may be absent.
    """

    name: str
    max_new_tokens: int
    stop_token_ids: list[int]

    def sample(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict[str, Any]]:
        """Reward of one response, and its JSON-able details."""
        ...


@dataclass(frozen=True)
class TaskContext:
    """What a task factory may use: the cache directory, and the engine's tokenizer when
    the engine runs in-process."""

    cache_dir: Path
    tokenizer: Any = None
    peers: Any = None  # producers.tasks.peers.PeerCalls: the peer policies episodes may call
    agents_score: bool = False  # the gateway's agents report the rewards: none is needed


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}
_FORWARDS: dict[str, Callable[..., Any]] = {}


def register_task(
    name: str, forwards: Callable[..., Any] | None = None
) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: register ``factory(context, **options) -> Task`` under ``name``. A
    factory that passes its ``**options`` on names where (``forwards``: a class or
    function), so that options can be checked before the task is built."""

    def decorate(factory: TaskFactory) -> TaskFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = factory
        if forwards is not None:
            _FORWARDS[name] = forwards
        return factory

    return decorate


def registered_factory(name: str) -> TaskFactory | None:
    return _REGISTRY.get(name)


def forwarded_to(name: str) -> Callable[..., Any] | None:
    """Where task ``name``'s factory passes the options it does not name, if declared."""
    return _FORWARDS.get(name)


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


# --- synthetic digit tasks (tiny model) ----------------------------------------------------


def score_digits(target: Sequence[int], response_ids: Sequence[int]) -> tuple[float, dict]:
    """Partial credit: share of positions of ``target digits + EOS`` that are right."""
    expected = [*digits_to_ids(target), EOS_ID]
    got = list(response_ids[: len(expected)])
    correct_positions = sum(int(a == b) for a, b in zip(expected, got, strict=False))
    answer_ids = list(response_ids)
    stopped = EOS_ID in answer_ids
    if stopped:
        answer_ids = answer_ids[: answer_ids.index(EOS_ID)]
    answer = "".join(TINY_VOCAB[t] for t in answer_ids if DIGIT0_ID <= t < DIGIT0_ID + 10)
    exact = got == expected
    details = {
        "target": "".join(str(d) for d in target),
        "answer": answer,
        "correct": exact,
        "format_ok": stopped and all(DIGIT0_ID <= t < DIGIT0_ID + 10 for t in answer_ids),
        "positions_correct": correct_positions,
        "positions": len(expected),
    }
    return correct_positions / len(expected), details


EVAL_SEED = 20261127  # the digit tasks' eval prompts: fixed, apart from any run's seed


@dataclass
class DigitsTask:
    """``BOS d1..dn SEP`` → ``f(digits) EOS`` on the tiny vocabulary."""

    name: str
    num_digits: int
    target_fn: Callable[[list[int]], list[int]]
    max_new_tokens: int = 8
    stop_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])
    eval_size: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.eval_size, bool) or not isinstance(self.eval_size, int):
            raise ValueError(f"eval_size must be an integer, got {self.eval_size!r}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be at least 1, got {self.eval_size}")

    def sample(self, rng: random.Random) -> Prompt:
        return self.prompt([rng.randrange(10) for _ in range(self.num_digits)])

    def prompt(self, digits: list[int]) -> Prompt:
        ids = [BOS_ID, *digits_to_ids(digits), SEP_ID]
        meta = {"digits": digits, "target": self.target_fn(digits)}
        return Prompt(ids, meta, "".join(map(str, digits)))  # the text between BOS and SEP

    def eval_prompts(self) -> list[Prompt]:
        """``eval_size`` distinct prompts, the same in every process. Training samples the
        same small space, so ``rollstream eval`` measures the policy on the task, not on
        prompts it never saw."""
        space = 10**self.num_digits
        picks = random.Random(EVAL_SEED).sample(range(space), min(self.eval_size, space))
        return [self.prompt([int(c) for c in f"{n:0{self.num_digits}d}"]) for n in picks]

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        return score_digits(prompt.meta["target"], response_ids)


@register_task("copy-first-digit-twice", forwards=DigitsTask)
def copy_first_digit_twice(context: TaskContext, num_digits: int = 3, **kw: Any) -> DigitsTask:
    return DigitsTask("copy-first-digit-twice", num_digits, lambda d: [d[0], d[0]], **kw)


@register_task("reverse-3-digits", forwards=DigitsTask)
def reverse_3_digits(context: TaskContext, **kw: Any) -> DigitsTask:
    return DigitsTask("reverse-3-digits", 3, lambda d: list(reversed(d)), **kw)


@register_task("repeat-digit", forwards=DigitsTask)
def repeat_digit(context: TaskContext, **kw: Any) -> DigitsTask:
    """``d`` written ``2d + 1`` times: a long tail of response lengths (2 to 20 tokens)."""
    kw.setdefault("max_new_tokens", 24)
    return DigitsTask("repeat-digit", 1, lambda d: [d[0]] * (2 * d[0] + 1), **kw)


# --- arithmetic word problems (SmolLM2) ---------------------------------------------------

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells")
SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem, then end with a final line "
    "'Answer: <number>'."
)
_ANSWER = re.compile(r"answer\s*[:=]\s*\$?\s*(-?\d[\d,]*)", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*")


ARITHMETIC_LEVELS = ("easy", "mixed", "two-step")

#: One worked example shown before the question (``one_shot``): a 135M model rarely meets
#: the ``Answer: N`` format from the instruction alone (measured: ~0 of 32 responses),
#: and meets it in about half of them after one example.
ONE_SHOT_EXAMPLE = (
    "Mia has 3 apples and gets 4 more. How many apples does Mia have now?",
    "3 + 4 = 7\nAnswer: 7",
)
#: The worked example of the ``two-step`` level: the same format, with both operations, so
#: the example teaches the form of the answer and not the arithmetic of any question.
TWO_STEP_EXAMPLE = (
    "Mia has 6 apples. Mia gets 5 more, then gives away 3. How many apples does Mia have now?",
    "6 + 5 = 11, 11 - 3 = 8\nAnswer: 8",
)
#: The arithmetic eval split's seed: fixed, apart from any run's seed.
ARITHMETIC_EVAL_SEED = 20261128
_QUESTION_NUMBERS = re.compile(r"\d+")


def check_level(level: str) -> None:
    """Refuse a level ``make_word_problem`` does not know, with the ones it does."""
    if level not in ARITHMETIC_LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; one of {ARITHMETIC_LEVELS}")


def make_word_problem(rng: random.Random, level: str = "mixed") -> tuple[str, int]:
    """A word problem with an integer answer, from a seeded ``rng``. ``easy``: one
    addition or subtraction of small numbers; ``mixed``: the four operations, numbers up
    to 90; ``two-step``: an addition and a subtraction in one question (numbers up to 15,
    answers 1 to 24), so no answer is one operation on the numbers shown."""
    check_level(level)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == "two-step":
        a, b = rng.randint(4, 15), rng.randint(2, 9)
        c = rng.randint(2, min(9, a + b - 1))
        if rng.random() < 0.5:
            return (
                f"{name} has {a} {item}. {name} gets {b} more, then gives away {c}. "
                f"How many {item} does {name} have now?",
                a + b - c,
            )
        a += c  # gives away first: never below zero
        return (
            f"{name} has {a} {item}. {name} gives away {c}, then gets {b} more. "
            f"How many {item} does {name} have now?",
            a - c + b,
        )
    if level == "easy":
        a, b = rng.randint(2, 12), rng.randint(1, 9)
        if rng.random() < 0.5:
            question = (
                f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            )
            return question, a + b
        a += b
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        return f"{name} has {a} {item}. {name} gets {b} more. How many {item} now?", a + b
    if kind == 1:
        a = rng.randint(10, 90)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item} and gave away {b}. How many {item} are left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return (
        f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does "
        "each friend get?",
        a,
    )


def score_arithmetic(
    text: str, answer: int, format_reward: float = 0.0
) -> tuple[float, dict[str, Any]]:
    """The exact answer earns ``1 - format_reward``, an ``Answer: N`` line
    (``format_ok``) earns ``format_reward``: with 0, 1.0 for the exact answer alone. The
    answer line is preferred; without one the last number in the text counts."""
    matches = _ANSWER.findall(text)
    format_ok = bool(matches)
    candidates = matches or _NUMBER.findall(text)
    parsed: int | None = None
    if candidates:
        try:
            parsed = int(candidates[-1].replace(",", ""))
        except ValueError:
            parsed = None
    correct = parsed == answer
    details = {"parsed": parsed, "answer": answer, "correct": correct, "format_ok": format_ok}
    reward = (1.0 - format_reward) * correct + format_reward * format_ok
    return reward, details


def word_problem_prompt(
    tokenizer: Any,
    system_prompt: str,
    rng: random.Random,
    level: str = "mixed",
    example: tuple[str, str] | None = None,
) -> Prompt:
    """A word problem from ``rng`` as a chat prompt under ``system_prompt``, after the
    worked ``example`` (question, answer) if one is given; its integer answer in
    ``meta["answer"]``."""
    question, answer = make_word_problem(rng, level)
    messages = [{"role": "system", "content": system_prompt}]
    if example is not None:
        messages += [
            {"role": "user", "content": example[0]},
            {"role": "assistant", "content": example[1]},
        ]
    messages.append({"role": "user", "content": question})
    return Prompt(chat_ids(tokenizer, messages), {"answer": answer}, question)


@dataclass
class ArithmeticTask:
    """Word problems for a small instruction-tuned model. The defaults are the ones a
    135M model learns from on 2 cores (``easy`` problems, one worked example, a format
    reward, 32 new tokens); ``level="mixed"``, ``one_shot=False``, ``format_reward=0``
    and ``max_new_tokens=96`` ask for more.

    ``eval_size`` > 0 gives the task a held-out split (``eval_prompts``): that many
    problems from a fixed seed, whose numbers training never samples (a training problem
    with the same numbers is drawn again), so the eval measures arithmetic, not recall."""

    tokenizer: Any
    name: str = "arithmetic"
    level: str = "easy"
    one_shot: bool = True
    format_reward: float = 0.2
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    eval_size: int = 0

    def __post_init__(self) -> None:
        check_level(self.level)  # at construction, not at the first sample
        if isinstance(self.format_reward, bool) or not isinstance(self.format_reward, int | float):
            raise ValueError(f"format_reward must be a number, got {self.format_reward!r}")
        if not 0.0 <= self.format_reward <= 1.0:
            raise ValueError(f"format_reward must be within [0, 1], got {self.format_reward}")
        if isinstance(self.eval_size, bool) or not isinstance(self.eval_size, int):
            raise ValueError(f"eval_size must be an integer, got {self.eval_size!r}")
        if not 0 <= self.eval_size <= 1000:
            raise ValueError(f"eval_size must be within [0, 1000], got {self.eval_size}")
        if not self.stop_token_ids:
            self.stop_token_ids = chat_stop_ids(self.tokenizer)
        self._held_out: set[tuple[str, ...]] = set()
        if self.eval_size:
            rng = random.Random(ARITHMETIC_EVAL_SEED)
            self._eval = [self._prompt(rng) for _ in range(self.eval_size)]
            self._held_out = {numbers_of(p.text) for p in self._eval}

    @property
    def example(self) -> tuple[str, str] | None:
        """The worked example shown before each question (none without ``one_shot``)."""
        if not self.one_shot:
            return None
        return TWO_STEP_EXAMPLE if self.level == "two-step" else ONE_SHOT_EXAMPLE

    def _prompt(self, rng: random.Random) -> Prompt:
        return word_problem_prompt(self.tokenizer, SYSTEM_PROMPT, rng, self.level, self.example)

    def sample(self, rng: random.Random) -> Prompt:
        for _ in range(1000):
            prompt = self._prompt(rng)
            if numbers_of(prompt.text) not in self._held_out:
                return prompt
        raise RuntimeError(f"level {self.level!r}: every problem drawn is held out for eval")

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split: ``eval_size`` problems, the same in every process."""
        if not self.eval_size:
            raise ValueError("the arithmetic task has no eval split: set its option eval_size")
        return list(self._eval)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        text = self.tokenizer.decode(list(response_ids), skip_special_tokens=True)
        return score_arithmetic(text, prompt.meta["answer"], self.format_reward)


def numbers_of(question: str) -> tuple[str, ...]:
    """The numbers of a question, in order: what makes two word problems the same sum."""
    return tuple(_QUESTION_NUMBERS.findall(question))


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """The chat template's rendering of ``messages``, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **template_kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def chat_stop_ids(tokenizer: Any) -> list[int]:
    """EOS and the chat template's end-of-turn token, where the tokenizer has one."""
    stops = {tokenizer.eos_token_id}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        stops.add(end)
    return sorted(t for t in stops if t is not None)


def hf_tokenizer(context: TaskContext, tokenizer: str | None) -> Any:
    """The engine's tokenizer when none is named, else that of the model spec ``tokenizer``
    (``core.models.load_tokenizer``); SmolLM2's when neither exists."""
    if tokenizer is None and context.tokenizer is not None:
        return context.tokenizer
    return load_tokenizer(tokenizer or SMOLLM2, context.cache_dir)


@register_task("arithmetic", forwards=ArithmeticTask)
def arithmetic(context: TaskContext, tokenizer: str | None = None, **kw: Any) -> ArithmeticTask:
    """Options: ``tokenizer`` (a model spec whose tokenizer to use, see ``core.models``;
    default: the engine's, else SmolLM2-135M-Instruct's), ``level`` (``easy``, ``mixed``
    or ``two-step``), ``one_shot``, ``format_reward`` (0 to 1), ``max_new_tokens``,
    ``stop_token_ids``, ``eval_size`` (held-out problems, 0: no eval split)."""
    return ArithmeticTask(hf_tokenizer(context, tokenizer), **kw)


__all__ = [
    "PAD_ID",
    "ArithmeticTask",
    "DigitsTask",
    "Prompt",
    "Task",
    "TaskContext",
    "load_object",
    "make_word_problem",
    "register_task",
    "registered_factory",
    "registered_names",
    "score_arithmetic",
    "score_digits",
]
