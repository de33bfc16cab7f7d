"""The suite's own layout: a test module imports its helpers from ``tests/support/``, never
from another test module (importing one runs its module-level set-up, models included, and
ties two files' fixtures together)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another() -> None:
    wrong = []
    for path in sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "support").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            wrong += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.startswith("test_")]
    assert not wrong, "import helpers from tests/support instead:\n" + "\n".join(wrong)
