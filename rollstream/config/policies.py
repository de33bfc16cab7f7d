"""Several policies in one run: each policy's roles see the run through its own view.

A multi-policy run declares its policies as ``[policies.<name>]`` tables. Each table holds
overrides in the layout of the whole file (``[policies.solver.profile] model = ...``,
``[policies.solver.streams.staleness] window = 1``), laid over the root settings for the
roles that serve that policy (``rollstream --policy solver stream``).

Routing is **topics per policy**: a policy's view renames every topic, consumer group and
state path of the run into that policy's namespace (``policy_namespace``), so a policy's
stream worker, trainer, weight lineage (``weights/<run>/<policy>/v<N>`` in S3), version
announcements, staleness window, snapshot store and heartbeats are its own. Nothing of one
policy's data flow is ever read by another policy's roles; the record's ``policy`` field
is checked on top of that, at the stream and at the trainer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from core.config import ConfigurationError, merge_tables

POLICY_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
"""A policy name: it becomes part of topic names, consumer groups and S3 keys."""

VERSION_LIKE = re.compile(r"^v\d+$")
"""Names a policy may not take: ``weights/<run>/<policy>/`` sits beside ``weights/<run>/v<N>/``."""

RESERVED_KEYS = frozenset({"policies", "policy", "run_id"})
"""Settings a policy's table may not override: the run and its policies are shared."""


def check_policy_tables(policies: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``policies`` with every name and table checked (``ValueError`` says which)."""
    for name, table in policies.items():
        if VERSION_LIKE.match(name):
            raise ValueError(
                f"policy name {name!r} looks like a weight version directory (v<digits>)"
            )
        if not POLICY_NAME.match(name):
            raise ValueError(
                f"policy name {name!r}: lower-case letters, digits, '-' and '_', "
                "starting with a letter, at most 32 characters"
            )
        if not isinstance(table, dict):
            raise ValueError(f"[policies.{name}] must be a table, got {type(table).__name__}")
        reserved = sorted(RESERVED_KEYS & table.keys())
        if reserved:
            raise ValueError(f"[policies.{name}] may not set {', '.join(reserved)}")
    return policies


def policy_namespace(values: dict[str, Any], policy: str) -> dict[str, Any]:
    """Explicit settings renaming every per-policy name of ``values`` (a whole config,
    defaults included) into ``policy``'s namespace: topics get ``.<policy>``, consumer
    groups and the stream's app id ``-<policy>``, state paths a ``<policy>`` part."""
    producers, streams, trainer = values["producers"], values["streams"], values["trainer"]

    def topic(name: str) -> str:
        return f"{name}.{policy}"

    def group(name: str) -> str:
        return f"{name}-{policy}"

    stream_topics = {
        key: topic(name)
        for key, name in streams["topics"].items()
        if isinstance(name, str) and name  # ticks may be unset: derived from the app id
    }
    trainer_topics: dict[str, Any] = {
        key: topic(trainer["topics"][key]) for key in ("scored", "dlq", "stale", "versions")
    }
    trainer_topics["group_id"] = group(trainer["topics"]["group_id"])
    if trainer["topics"].get("group_instance_id"):
        trainer_topics["group_instance_id"] = group(trainer["topics"]["group_instance_id"])

    def own_file(name: str) -> str:  # trainer.jsonl -> trainer.<policy>.jsonl
        path = Path(name)
        return str(path.with_name(f"{path.stem}.{policy}{path.suffix}"))

    trainer_section: dict[str, Any] = {"topics": trainer_topics}
    for key in ("metrics_file", "ledger_file"):
        if trainer.get(key):
            trainer_section[key] = own_file(trainer[key])
    evaluation: dict[str, Any] = {}
    if producers["eval"].get("metrics_file"):
        evaluation["metrics_file"] = own_file(producers["eval"]["metrics_file"])
    if trainer["checkpoint"].get("dir"):
        trainer_section["checkpoint"] = {"dir": str(Path(trainer["checkpoint"]["dir"]) / policy)}
    return {
        "policy": policy,
        "weights": {"topic": topic(values["weights"]["topic"])},
        "presence": {"topic": topic(values["presence"]["topic"])},
        "producers": {
            "rollout": {
                "topic": topic(producers["rollout"]["topic"]),
                "curriculum": {"topic": topic(producers["rollout"]["curriculum"]["topic"])},
                "gateway": {
                    "dead_letter_topic": topic(producers["rollout"]["gateway"]["dead_letter_topic"])
                },
            },
            "eval": evaluation,
        },
        "streams": {"app_id": group(streams["app_id"]), "topics": stream_topics},
        "trainer": trainer_section,
    }


def policy_values(
    explicit: dict[str, Any], defaults: dict[str, Any], policies: dict[str, Any], policy: str
) -> dict[str, Any]:
    """The explicit settings of ``policy``'s view: the root's explicit settings, the
    names renamed into the policy's namespace, then the policy's own table on top."""
    if policy not in policies:
        known = ", ".join(sorted(policies)) or "none: this run has a single policy"
        raise ConfigurationError(f"unknown policy {policy!r} (policies of this run: {known})")
    renamed = policy_namespace(defaults, policy)
    return merge_tables(merge_tables(explicit, renamed), policies[policy])
