"""A scored group read twice is trained once, on the real broker, across a restart.

The stream emits each group once; should a copy reach ``rollouts.scored`` anyway, the
trainer remembers the groups it trained lately (in its checkpoint state) and refuses the
copy: counted in its summary and metrics, listed in its ledger for the audit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from support.synthetic import synthetic_groups
from support.trainer_runs import (
    end_and_committed,
    group_records,
    ids_of,
    make_topics,
    metrics_lines,
    produce,
    settings_for,
)

from consumers.checkpoint import TrainingLedger
from consumers.trainer import Trainer
from core.config import KafkaConfig

RUN = "trainer-test"


def run_until(trainer: Trainer, done: Callable[[], bool], timeout_s: float = 120) -> None:
    """Run ``trainer`` in a thread until ``done()``, then stop it cleanly (final checkpoint)."""
    finished = threading.Event()
    thread = threading.Thread(target=lambda: (trainer.run(), finished.set()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.2)
    trainer.request_stop()
    thread.join(60)
    assert finished.is_set(), trainer.summary


def test_a_group_delivered_twice_is_trained_once_even_after_a_restart(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    topics = make_topics(kafka_config, unique_name)
    g0, g1, g2, g3 = synthetic_groups(4, seed=61, run_id=RUN)
    # life 2 starts at step 3: a version-0 group would be over the window of 2 there
    (g4,) = synthetic_groups(1, seed=62, run_id=RUN, version=3)
    groups = [g0, g1, g2, g3, g4]
    size = len(g0)
    # life 1: g1 twice in a row, g2 again after g3; all in one partition, so the trainer reads
    # them in this order (across partitions, which copy comes when depends on each fetch: a
    # copy read after the last step that could take it is refused only by a later step)
    produce(kafka_config, topics["scored"], group_records([g0, g1, g1, g2, g3, g2]), partition=0)
    first = Trainer(*settings_for(tmp_path, topics, kafka_config))
    run_until(
        first,
        lambda: first.summary.trained == 4 * size and first.summary.refused_groups == 2,
    )
    assert first.summary.trained == 4 * size and first.summary.refused_groups == 2

    # life 2: restored from the final checkpoint, which remembers g0..g3
    produce(kafka_config, topics["scored"], group_records([g0, g4]), partition=0)
    second = Trainer(*settings_for(tmp_path, topics, kafka_config))
    run_until(
        second,
        lambda: second.summary.trained == size and second.summary.refused_groups == 1,
    )
    assert second.summary.trained == size and second.summary.refused_groups == 1

    ledger_path = tmp_path / "ledger.jsonl"
    trained = sorted(i for _, ids in TrainingLedger.read(ledger_path) for i in ids)
    assert trained == sorted(ids_of(groups))  # each sample once
    assert sorted(TrainingLedger.read_refused(ledger_path)) == sorted(ids_of([g1, g2, g0]))
    lines = metrics_lines(tmp_path)
    assert sum(m["data/refused_groups"] for m in lines) == 3
    ends, committed = end_and_committed(
        kafka_config, topics["scored"], f"trainer-{topics['scored']}"
    )
    assert committed[0] == ends[0] == sum(ends.values()) == 8  # the other partitions: empty
