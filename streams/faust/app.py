"""The stream worker's Faust app: ``build_app`` builds it, ``run_worker`` runs it
(``rollstream stream``).

The decisions live in plain modules (``streams.processor``, ``.oldlogits``,
``.snapshots``, ``.staleness``); ``streams.faust.worker.StreamWorker`` wires them to
Kafka, its parts in ``streams.faust.topics`` (what topics exist) and
``streams.faust.agent`` (the agent's work per message). Configuration is passed in: the
``[streams]`` section and the shared sections (Kafka, S3, weights).

Per message on ``rollouts.raw`` (keyed by group id): decode, validate, staleness check,
add to the group's table entry; when the group is complete (or every sample is
accounted for), compute exact old logits in a one-thread executor — never on the event
loop, so heartbeats and commits go on — and emit the ``ScoredGroup``. A timer sends
*ticks* to the partitions holding overdue groups (the internal ticks topic is
co-partitioned with raw), so timeouts close groups inside the same per-partition
transactions as everything else (``streams.faust.txn`` explains the exactly-once argument).
A second timer sweeps for records Faust fetched but never handed to the agent
(``streams.faust.gaps``).

Scaling out: start more workers with the same ``app_id``. Faust's assignor gives each
worker whole partitions of raw, ticks and the table changelog together (a group never
spans workers), and each worker runs its own forward passes: old-logit compute scales
with the number of workers up to the raw partition count (8), as long as each worker
has its own cores (set ``old_logits.torch_threads`` to the cores per worker). Each worker
holds its own snapshot store, so memory for snapshots grows with the worker count.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import faust

from core.config import SharedConfig
from streams.config import StreamsConfig
from streams.faust.faust_logs import quiet_commit_alarms
from streams.faust.worker import StreamWorker

log = logging.getLogger("streams")


def build_app(shared: SharedConfig, config: StreamsConfig, datadir: Path) -> faust.App:
    """The Faust app of one stream worker, with its agent, timers and services wired, its
    local state under ``datadir``.

    Creating it declares missing topics and opens Kafka clients; nothing happens at
    import. ``run_worker`` starts it.
    """
    return StreamWorker(shared, config, datadir).app


def run_worker(app: faust.App, loglevel: str = "info") -> NoReturn:
    """Run ``app`` as a Faust worker in this process until it is stopped, then end the
    process with the worker's exit code.

    Why a hard exit: a worker stopped early (SIGTERM during its first transaction) can
    leave Kafka client threads behind that the interpreter waits for at exit, so the
    process lived on as a group member holding partitions it no longer processed. Once
    Faust has stopped, nothing of the worker's needs the interpreter's shutdown: its
    transactions are committed or aborted, and the broker drops the member.
    """
    if app.conf.processing_guarantee.value == "exactly_once":
        quiet_commit_alarms(log)
    sys.argv = [
        sys.argv[0],
        f"--datadir={app.conf.datadir}",
        "worker",
        "--without-web",
        "-l",
        loglevel,
    ]
    code = 0
    try:
        app.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        log.exception("stream worker failed")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
