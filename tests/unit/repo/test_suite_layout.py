"""The suite's own layout: the tier is the folder and the package the sub-folder
(``tests/<tier>/<package>/test_<subject>.py``), a file sits in the folder of its slowest
test, and a test module imports its helpers from ``tests/support/``, never from another
test module (importing one runs its module-level set-up, models included, and ties two
files' fixtures together)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO, TESTS
from support.tiers import TIERS, misfiled

pytestmark = pytest.mark.unit

PYTEST = (sys.executable, "-m", "pytest")
PACKAGES = {
    "bench",
    "consumers",
    "core",
    "infra",
    "producers",
    "repo",  # the repository as a whole: architecture, docs, dependencies, this layout
    "rollstream",
    "schemas",
    "streams",
    "weights",
}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts)


def _test_files() -> list[Path]:
    return [p for p in _modules() if p.name.startswith("test_")]


def _imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def _names_a_test_module(module: str) -> bool:
    parts = module.lstrip(".").split(".")
    return (module.startswith(".") and "support" not in parts[:1]) or any(
        part.startswith("test_") or part in TIERS for part in parts
    )


def test_no_test_module_imports_another() -> None:
    wrong = [
        f"{path.relative_to(TESTS)}: {name}"
        for path in _modules()
        if path.parent != TESTS / "support"
        for name in _imported(path)
        if _names_a_test_module(name)
    ]
    assert not wrong, "import helpers from tests/support instead:\n" + "\n".join(wrong)


def test_the_import_check_catches_each_way_of_naming_a_test_module() -> None:
    for module in ("test_gaps", "tests.test_gaps", "unit.streams.test_gaps", ".test_gaps", "."):
        assert _names_a_test_module(module), module
    for module in ("support.streams", "streams.faust.gaps", "pytest", "tests.support.streams"):
        assert not _names_a_test_module(module), module


def test_every_test_file_sits_in_a_tier_and_a_package_folder() -> None:
    wrong = []
    for path in _test_files():
        parts = path.relative_to(TESTS).parts
        if len(parts) != 3 or parts[0] not in TIERS or parts[1] not in PACKAGES:
            wrong.append(str(path.relative_to(TESTS)))
    for path in _modules():
        where = path.relative_to(TESTS).parts
        helper = where[0] == "support" or path.name in ("__init__.py", "conftest.py")
        if not helper and not path.name.startswith("test_"):
            wrong.append(f"{path.relative_to(TESTS)} (a helper belongs in tests/support/)")
    assert _test_files() and not wrong, "\n".join(wrong)


def test_a_test_filed_in_a_faster_folder_than_its_tier_is_refused() -> None:
    unit, integration = TESTS / "unit" / "core" / "test_a.py", TESTS / "integration" / "x.py"
    system = TESTS / "system" / "core" / "test_c.py"
    items = [
        ("a::ok", unit, "unit"),
        ("a::kafka", unit, "integration"),
        ("b::chaos", integration, "system"),
        ("c::quick", system, "unit"),  # a quick test in a slow file is allowed
        ("d::loose", TESTS / "test_d.py", "unit"),
    ]
    assert misfiled(items, TESTS) == [
        "a::kafka: an integration test in tests/unit/",
        "b::chaos: a system test in tests/integration/",
        "d::loose: not under tests/{system,integration,unit}/",
    ]


@pytest.mark.parametrize("tier", ["integration", "system"])
def test_each_file_of_a_slow_folder_holds_a_test_of_that_tier(
    tier: str, request: pytest.FixtureRequest
) -> None:
    """A file in ``tests/system`` (``tests/integration``) has at least one test of that tier:
    an integration file moved there would hide among the slow ones. The tiers are read off
    this session's own items where it collected the whole folder (the suite), else off a
    collection of the folder (a run of the unit tier alone)."""
    paths = {p for p in _test_files() if p.is_relative_to(TESTS / tier)}
    selected = not (request.config.option.markexpr or request.config.option.keyword)
    holding = _files_holding(tier, paths, request.session.items) if selected else set()
    holding = holding or _collected_files_holding(tier)
    files = {str(p.relative_to(REPO)) for p in paths}
    assert files and files == holding, sorted(files - holding)


def _files_holding(tier: str, paths: set[Path], items: list[pytest.Item]) -> set[str]:
    """Files of ``tests/<tier>`` (``paths``) with a test of that tier among ``items``;
    empty unless every one of them was collected."""
    folder = TESTS / tier
    collected = {item.path for item in items if item.path.is_relative_to(folder)}
    if collected != paths:
        return set()
    return {
        str(item.path.relative_to(REPO))
        for item in items
        if item.path.is_relative_to(folder) and item.get_closest_marker(tier) is not None
    }


def _collected_files_holding(tier: str) -> set[str]:
    done = subprocess.run(
        [*PYTEST, "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", tier,
         f"tests/{tier}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(TESTS)))},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
