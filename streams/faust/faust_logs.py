"""Faust log lines that are false alarms in this app, explained once instead of repeated.

With ``processing_guarantee = "exactly_once"`` the offsets of every step commit inside the
step's transaction (``streams.faust.txn``), not through Faust's consumer commit, so Faust's
livelock detector never sees a commit and logs "Has not committed TP(...) at all since
worker start ... report as bug" at ERROR level every few minutes while processing is
healthy. ``CommitAlarmFilter`` drops those lines and logs one INFO line per partition
that says why; progress is watched by the table's watermarks (``streams.faust.gaps``).
"""

from __future__ import annotations

import logging

FAUST_CONSUMER_LOGGER = "faust.transport.drivers.aiokafka"
ALARMS = ("Has not committed",)


class CommitAlarmFilter(logging.Filter):
    """Drops Faust's commit-livelock alarms; explains each partition's once."""

    def __init__(self, explain_to: logging.Logger) -> None:
        super().__init__()
        self.explain_to = explain_to
        self.explained: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not any(alarm in message for alarm in ALARMS):
            return True
        partition = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        if partition not in self.explained:
            self.explained.add(partition)
            self.explain_to.info(
                "Faust reports no consumer commit for %s: expected, this app commits offsets "
                "inside its transactions (exactly once); the alarm is not repeated",
                partition,
            )
        return False


def quiet_commit_alarms(explain_to: logging.Logger) -> CommitAlarmFilter:
    """Install ``CommitAlarmFilter`` on Faust's consumer logger; returns it."""
    alarm_filter = CommitAlarmFilter(explain_to)
    logging.getLogger(FAUST_CONSUMER_LOGGER).addFilter(alarm_filter)
    return alarm_filter
