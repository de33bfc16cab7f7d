"""A curriculum that feeds back from the stream: skip prompts that are solved or hopeless.

The stream publishes, per prompt and per stream partition, what its groups scored
(``schemas.control.PromptStats`` on the compacted ``prompts.stats`` topic, cumulative, keyed
``<run>:<prompt>:<partition>``). ``PromptStatsReader`` follows that topic in a background
thread (from its start: compaction keeps the latest value of every key) and folds the
partitions of each prompt of this run into a ``PromptStatsView``. Before a group starts,
the worker asks ``Curriculum.choose`` for a prompt: a prompt with at least ``min_samples``
samples whose pass rate is at or above ``max_pass_rate`` (solved) or, if set, at or below
``min_pass_rate`` (hopeless) is skipped and another one is drawn, at most ``max_skips``
times; then the last one drawn is used, so generation never stalls when every prompt is
outside the band. Prompts the stream has not seen are always taken.

Why by prompt token ids: the stream sees tokens, not a task's notion of an example, and
``schemas.control.prompt_key`` gives both sides the same key without a schema change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from producers.config import CurriculumConfig
from schemas.control import PromptStats, prompt_key

logger = logging.getLogger(__name__)

P = TypeVar("P")


@dataclass
class PromptTotals:
    """One prompt's statistics summed over the stream partitions that reported it."""

    by_partition: dict[int, PromptStats] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.by_partition.values())

    @property
    def pass_rate(self) -> float:
        samples = self.samples
        return sum(s.passes for s in self.by_partition.values()) / samples if samples else 0.0


class PromptStatsView:
    """The latest statistics of every prompt of one run (thread-safe)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._prompts: dict[str, PromptTotals] = {}
        self._lock = threading.Lock()
        self.malformed = 0

    def apply(self, value: bytes | None) -> None:
        """Fold one record of the topic in (another run's or a malformed one is skipped)."""
        if value is None:
            return
        try:
            stats = PromptStats.from_json(value)
        except ValueError as exc:
            self.malformed += 1
            logger.warning("skipping a malformed prompts.stats record: %s", exc)
            return
        if stats.run_id != self.run_id:
            return
        with self._lock:
            totals = self._prompts.setdefault(stats.prompt_key, PromptTotals())
            totals.by_partition[stats.partition] = stats

    def get(self, key: str) -> PromptTotals | None:
        with self._lock:
            return self._prompts.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._prompts)


class Curriculum:
    """Chooses prompts for new groups (see the module doc)."""

    def __init__(
        self,
        config: CurriculumConfig,
        view: PromptStatsView,
        on_skip: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.view = view
        self.on_skip = on_skip

    def skip_reason(self, prompt_ids: object) -> str | None:
        """``solved``, ``hopeless`` or None (take it)."""
        totals = self.view.get(prompt_key(prompt_ids))
        if totals is None or totals.samples < self.config.min_samples:
            return None
        rate = totals.pass_rate
        if rate >= self.config.max_pass_rate:
            return "solved"
        if self.config.min_pass_rate is not None and rate <= self.config.min_pass_rate:
            return "hopeless"
        return None

    def choose(self, draw: Callable[[], P]) -> P:
        """A prompt from ``draw()`` inside the band, or the last one drawn."""
        prompt = draw()
        for _ in range(self.config.max_skips):
            reason = self.skip_reason(getattr(prompt, "ids", prompt))
            if reason is None:
                return prompt
            if self.on_skip is not None:
                self.on_skip(reason)
            prompt = draw()
        return prompt


class PromptStatsReader:
    """Follows ``prompts.stats`` into a ``PromptStatsView`` in a daemon thread."""

    def __init__(self, client_config: Mapping[str, str], topic: str, view: PromptStatsView) -> None:
        from confluent_kafka import Consumer

        from core.topic_reader import reader_config

        self.topic = topic
        self.view = view
        config = reader_config(client_config, f"prompt-stats-{view.run_id}")
        self._consumer = Consumer({**config, "enable.partition.eof": False})
        self._stop = threading.Event()
        self._assigned = False
        self._thread = threading.Thread(target=self._run, name="prompt-stats", daemon=True)

    def start(self) -> PromptStatsReader:
        self._thread.start()
        return self

    def _assign(self) -> bool:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        metadata = self._consumer.list_topics(self.topic, timeout=5.0).topics.get(self.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return False
        self._consumer.assign(
            [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in metadata.partitions]
        )
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._assigned:
                    self._assigned = self._assign()
                    if not self._assigned:  # the stream has not created it yet
                        self._stop.wait(2.0)
                        continue
                for msg in self._consumer.consume(num_messages=500, timeout=0.5):
                    if msg.error() is None:
                        self.view.apply(msg.value())
            except Exception:  # the curriculum is advisory: never take the producer down
                logger.exception("reading %s failed; retrying", self.topic)
                self._stop.wait(2.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._consumer.close()
