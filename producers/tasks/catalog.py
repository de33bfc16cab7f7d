"""Every task a producer can run, by name: the single-turn tasks (``producers.tasks.base``) and
the multi-turn environments (``producers.tasks.environments``), both registered with
``register_task``, or a user's factory named by dotted path (``package.module:factory``).

Its own module because the environments build on the tasks: looking a name up here
imports both, and neither imports the other's registrations.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import producers.tasks.environments
import producers.tasks.file
import producers.tasks.games  # noqa: F401  (registers the multi-policy tasks)
from core.config import ConfigurationError
from producers.tasks.base import (
    Task,
    TaskContext,
    forwarded_to,
    load_object,
    registered_factory,
    registered_names,
)


def available_tasks() -> list[str]:
    return registered_names()


def check_task_options(name: str, options: Mapping[str, Any], section: str) -> None:
    """Refuse ``options`` that task ``name``'s factory does not take, or lack one it
    needs, naming the key and ``section``: before a run starts rather than as a
    ``TypeError`` in a role's log. A factory given as ``module:attr``, or one that takes
    ``**options`` without declaring where they go, is checked only when it is built."""
    factory = registered_factory(name)
    if factory is None:
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    own = list(inspect.signature(factory).parameters.values())[1:]  # after the context
    named = [p for p in own if p.kind in kinds]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own):
        forwards = forwarded_to(name)
        if forwards is None:
            return
        named += [p for p in inspect.signature(forwards).parameters.values() if p.kind in kinds]
    unknown = sorted(set(options) - {p.name for p in named})
    missing = [
        p.name for p in own if p.kind in kinds and p.default is p.empty and p.name not in options
    ]
    problems = [f"unknown option {key!r}" for key in unknown]
    problems += [f"missing option {key!r}" for key in missing]
    if problems:
        accepted = ", ".join(dict.fromkeys(p.name for p in named)) or "none"
        raise ConfigurationError(
            f"[{section}] task_options of task {name!r}: {'; '.join(problems)} "
            f"(it takes: {accepted})"
        )


def make_task(name: str, options: dict[str, Any] | None, context: TaskContext) -> Task:
    """Build a registered task or environment, or one whose factory is given as
    ``module:attr``."""
    check_task_options(name, options or {}, "producers.rollout")
    factory = registered_factory(name)
    if factory is None:
        if ":" not in name and "." not in name:
            raise KeyError(f"unknown task {name!r}; registered: {available_tasks()}")
        factory = load_object(name)
    task = factory(context, **(options or {}))
    for attr in ("name", "max_new_tokens", "stop_token_ids", "sample"):
        if not hasattr(task, attr):
            raise TypeError(f"task {name!r} built by {factory!r} has no {attr!r}")
    if not hasattr(task, "reward") and not hasattr(task, "score_group"):
        raise TypeError(f"task {name!r} built by {factory!r} has no 'reward' or 'score_group'")
    return task
