"""Crash-test failpoints: the trainer SIGKILLs itself at a named point of a named step.

Only the crash tests set ``ROLLSTREAM_TRAINER_FAILPOINT`` (``name:step``). A kill at a
chosen point proves what a crash there leaves behind; the warning logged first proves the
kill landed there and not somewhere benign. ``name:step:stop`` sends SIGTERM instead: a
stop request (what ``up`` or a user sends) landing at a known step. The points:

- ``after_checkpoint:N``: checkpoint N is durable (LATEST marked), before its stale groups
  are routed, its ledger lines written and its offsets committed;
- ``after_route_stale:N``: checkpoint N's stale groups are on ``rollouts.stale``, before
  the ledger append;
- ``after_ledger:N``: checkpoint N's ledger lines are written, before the offset commit;
- ``mid_checkpoint:N``: the engine's files of checkpoint N are written, LATEST not yet;
- ``mid_publish:N``: the data file of version N is uploaded, its manifest not yet claimed.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

FAILPOINT_ENV = "ROLLSTREAM_TRAINER_FAILPOINT"
FAILPOINTS = (
    "after_checkpoint",
    "after_route_stale",
    "after_ledger",
    "mid_checkpoint",
    "mid_publish",
)


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process when the environment names ``name:step``, SIGTERM it when it
    names ``name:step:stop``; otherwise nothing."""
    chosen = os.environ.get(FAILPOINT_ENV)
    if chosen == f"{name}:{step}:stop":
        log.warning("failpoint %s:%d: asking this process to stop", name, step)
        os.kill(os.getpid(), signal.SIGTERM)
    elif chosen == f"{name}:{step}":
        log.warning("failpoint %s:%d: killing this process", name, step)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
