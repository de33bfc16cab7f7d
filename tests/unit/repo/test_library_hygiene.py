"""Library code neither waits forever on a child process nor changes the process
environment behind its caller's back (checked on the source, for every library package).

A ``subprocess.run`` without ``timeout`` hangs its caller when the tool hangs (a Maven
Central that stops answering, a JVM stuck at start-up); a library that writes
``os.environ`` changes what every other library and every later child process of the
same process sees. Environments are passed explicitly (``env=`` of the child, arguments
of the call).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import REPO

LIBRARY = ("core", "schemas", "weights", "infra", "producers", "streams", "consumers", "rollstream")
BLOCKING = frozenset({"run", "call", "check_call", "check_output"})
ENV_WRITERS = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__"})

#: Known writers of ``os.environ``, each with why the environment is the only interface.
ENV_ALLOWED = {
    # scoped to the guarded block and restored: DeepSpeed's JIT builder has no
    # build-directory argument, torch reads TORCH_EXTENSIONS_DIR at every build
    ("consumers/build_lock.py", "extensions_dir"),
    # DeepSpeed reads DS_ACCELERATOR and the torch.distributed rendezvous variables
    # (RANK, WORLD_SIZE, MASTER_ADDR, ...) from the environment only
    ("consumers/train_engine.py", "resolve_accelerator"),
    ("consumers/train_engine.py", "init_distributed"),
    # a process forked to become a role takes the role's environment, as exec would give it
    ("core/prefork.py", "become_role"),
}


def library_files() -> list[Path]:
    return sorted(p for package in LIBRARY for p in (REPO / package).rglob("*.py"))


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


class Finder(ast.NodeVisitor):
    """Blocking subprocess calls without ``timeout`` and writes to ``os.environ``, with
    the function they are in."""

    def __init__(self) -> None:
        self.function = "<module>"
        self.no_timeout: list[tuple[str, int]] = []
        self.env_writes: list[tuple[str, int]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in BLOCKING
            and isinstance(func.value, ast.Name)
            and func.value.id == "subprocess"
            and not any(k.arg == "timeout" for k in node.keywords)
        ):
            self.no_timeout.append((self.function, node.lineno))
        if isinstance(func, ast.Attribute) and (
            (func.attr in ENV_WRITERS and _is_os_environ(func.value))
            or (
                func.attr in ("putenv", "unsetenv")
                and isinstance(func.value, ast.Name)
                and func.value.id == "os"
            )
        ):
            self.env_writes.append((self.function, node.lineno))
        self.generic_visit(node)

    def _targets(self, targets: list[ast.expr], lineno: int) -> None:
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_os_environ(target.value):
                self.env_writes.append((self.function, lineno))
            if _is_os_environ(target):
                self.env_writes.append((self.function, lineno))

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target], node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node.targets, node.lineno)
        self.generic_visit(node)


def scan(path: Path) -> Finder:
    finder = Finder()
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder


def test_every_blocking_subprocess_call_has_a_timeout() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line} in {function}()"
        for path in library_files()
        for function, line in scan(path).no_timeout
    ]
    assert not found, "subprocess calls without timeout=:\n" + "\n".join(found)


def test_library_code_does_not_change_the_environment() -> None:
    found = [
        f"{rel}:{line} in {function}()"
        for path in library_files()
        for function, line in scan(path).env_writes
        if ((rel := str(path.relative_to(REPO))), function) not in ENV_ALLOWED
    ]
    assert not found, "os.environ changed by library code:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "timeouts", "writes"),
    [
        ("import subprocess\nsubprocess.run(['x'])", 1, 0),
        ("import subprocess\nsubprocess.check_output(['x'], timeout=3)", 0, 0),
        ("import os\nos.environ['A'] = '1'", 0, 1),
        ("import os\nos.environ.setdefault('A', '1')", 0, 1),
        ("import os\ndel os.environ['A']", 0, 1),
        ("import os\nos.putenv('A', '1')", 0, 1),
        ("import os\nenv = {**os.environ, 'A': '1'}\nx = os.environ.get('A')", 0, 0),
    ],
)
def test_the_scan_finds_what_it_looks_for(source: str, timeouts: int, writes: int) -> None:
    finder = Finder()
    finder.visit(ast.parse(source))
    assert (len(finder.no_timeout), len(finder.env_writes)) == (timeouts, writes)
