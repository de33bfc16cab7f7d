"""The suite's three tiers, from the folder a test file sits in and from what the test uses.

A test's tier is ``system`` when it (or its module) is marked so, ``integration`` when it
uses a real service (a service fixture, or an ``integration`` mark), ``unit`` otherwise. A
file sits in the folder of its slowest test: ``tests/unit`` holds no test that needs a
service, ``tests/integration`` none marked ``system``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

TIERS = ("system", "integration", "unit")
"""Slowest first: the order files are handed to the workers in."""

SERVICE_FIXTURES = frozenset(
    {"kafka_config", "s3_config", "second_s3_config", "seaweed_region_a", "seaweed_region_b"}
)


def marked_tier(item: pytest.Item) -> str:
    """The tier of one test from its marks and the fixtures it uses."""
    if item.get_closest_marker("system"):
        return "system"
    uses_services = SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))
    if uses_services or item.get_closest_marker("integration"):
        return "integration"
    return "unit"


def folder_tier(path: Path, tests: Path) -> str | None:
    """The tier folder ``path`` sits in under ``tests``, or None when it sits in none."""
    try:
        top = path.relative_to(tests).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


def misfiled(items: Iterable[tuple[str, Path, str]], tests: Path) -> list[str]:
    """``(node id, file, marked tier)`` of tests outside any tier folder or in a folder
    faster than their tier (a service test under ``tests/unit``), one line each."""
    wrong = []
    for nodeid, path, tier in items:
        folder = folder_tier(path, tests)
        if folder is None:
            wrong.append(f"{nodeid}: not under tests/{{{','.join(TIERS)}}}/")
        elif TIERS.index(tier) < TIERS.index(folder):
            article = "an" if tier[0] in "aeiou" else "a"
            wrong.append(f"{nodeid}: {article} {tier} test in tests/{folder}/")
    return wrong
