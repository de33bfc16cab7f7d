"""CPU seconds per test, printed beside pytest's wall-clock durations.

On two shared cores the suite's length is set by how much CPU its tests burn, not by how
long each waits, and a test's wall time under three workers mostly says how busy the
others were. Each test is charged the CPU of its worker process, of every child process
reaped meanwhile (``RUSAGE_CHILDREN``: a role that ``up`` started and stopped, a CLI
command) and of every role it forked that exited meanwhile (a trainer life, a stream
worker: ``support.forked_roles``, whose server reports them), setup and teardown included,
so a module fixture's run lands on the module's first test. Not charged: the session's
shared broker and stores (started by xdist's controller, or reaped after the last test,
so that test stops counting at the end of its call), the forked roles' server (its
imports, once per worker) and a child killed but never waited for.
"""

from __future__ import annotations

import resource
from collections.abc import Generator
from typing import Any

import pytest

from .forked_roles import reaped_cpu_s

START = pytest.StashKey[float]()
LAST = pytest.StashKey[bool]()
TOP = 25


def cpu_seconds() -> float:
    """User + system CPU of this process and of its reaped children, so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = reaped_cpu_s()
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, None]:
    item.stash[START] = cpu_seconds()
    item.stash[LAST] = nextitem is None  # the session's services stop in its teardown
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    ends_here = "call" if item.stash.get(LAST, False) else "teardown"
    if call.when == ends_here and START in item.stash:
        report.user_properties.append(("cpu_s", round(cpu_seconds() - item.stash[START], 1)))


class CpuSummary:
    """Collects the workers' figures on the controller and prints the heaviest tests."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == "cpu_s":
                self.cpu[report.nodeid] = float(value)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.cpu:
            return
        total = sum(self.cpu.values())
        terminalreporter.write_sep("=", f"most CPU: {TOP} of {total:.0f} CPU-seconds in tests")
        for nodeid, seconds in sorted(self.cpu.items(), key=lambda kv: -kv[1])[:TOP]:
            terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(CpuSummary(), "rollstream-cpu-summary")
