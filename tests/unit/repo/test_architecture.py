"""The layer rule, checked on the import graph: no module imports its way back to itself.

``lint-imports`` (run by the test command) checks the direction of imports between
layers; this test checks what import-linter does not: no import cycle between any two
modules of the project, function-level imports included.
"""

from __future__ import annotations

import grimp

PACKAGES = (
    "rollstream",
    "producers",
    "streams",
    "consumers",
    "infra",
    "weights",
    "core",
    "schemas",
)


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    imported = graph.find_modules_directly_imported_by(child)
                    work.append((child, iter(sorted(imported))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]
