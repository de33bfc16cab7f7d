"""Where the suite's files are, from wherever a test module sits in ``tests/<tier>/<package>/``."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SUPPORT = TESTS / "support"
DATA = TESTS / "data"
