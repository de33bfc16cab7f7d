"""Every task a producer can run, by name: the single-turn tasks (``producers.tasks``) and
the multi-turn environments (``producers.environments``), both registered with
``register_task``, or a user's factory named by dotted path (``package.module:factory``).

Its own module because the environments build on the tasks: looking a name up here
imports both, and neither imports the other's registrations.
"""

from __future__ import annotations

from typing import Any

import producers.environments
import producers.file_task
import producers.games  # noqa: F401  (registers the multi-policy tasks)
from producers.tasks import Task, TaskContext, load_object, registered_factory, registered_names


def available_tasks() -> list[str]:
    return registered_names()


def make_task(name: str, options: dict[str, Any] | None, context: TaskContext) -> Task:
    """Build a registered task or environment, or one whose factory is given as
    ``module:attr``."""
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
