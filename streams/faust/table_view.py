"""The stream app's table as its committed changelog holds it, read from outside the app.

Tools that must know what the stream has really done (``rollstream audit``, the tests'
"everything applied" waits) read the table's changelog rather than the app's consumer
offsets: Faust's committed offsets can run ahead of what the table applied
(``streams.faust.gaps``). The changelog is ``<app_id>-groups-changelog``; its records are the
raw table writes of ``streams.groups`` (a ``None`` value deletes a key), so folding it
gives the table: the source watermarks (``o:`` keys) and the groups still being assembled
(``g:`` keys whose state is not closed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.topic_reader import read_range, reader_config, whole_topic
from streams.groups import GROUP_PREFIX, GroupState, offset_key


def changelog_topic(app_id: str) -> str:
    """The changelog topic of the ``groups`` table of the app ``app_id``."""
    return f"{app_id}-groups-changelog"


@dataclass
class TableView:
    """The folded table: the latest value of every key still present."""

    entries: dict[bytes, bytes] = field(default_factory=dict)

    def applied(self, topic: str, partitions: list[int]) -> dict[int, int]:
        """Last source offset applied per partition of ``topic`` (absent: none yet)."""
        found = {}
        for partition in partitions:
            value = self.entries.get(offset_key(topic, partition))
            if value is not None:
                found[partition] = int(value)
        return found

    def open_groups(self) -> list[GroupState]:
        """Groups whose samples the table holds, not yet closed (emitted or dropped)."""
        states = (
            GroupState.from_bytes(value)
            for key, value in self.entries.items()
            if key.startswith(GROUP_PREFIX)
        )
        return [state for state in states if not state.closed]


def read_table(client_config: Mapping[str, str], app_id: str, timeout_s: float = 60.0) -> TableView:
    """Fold the committed changelog of ``app_id``'s table (empty if the app has not
    created it yet)."""
    from confluent_kafka import Consumer, KafkaException

    view = TableView()
    topic = changelog_topic(app_id)
    consumer = Consumer(reader_config(client_config, "table"))
    try:
        try:
            plan = whole_topic(consumer, topic)
        except KafkaException:
            return view
        for msg in read_range(consumer, topic, plan, timeout_s):
            key, value = msg.key(), msg.value()
            if key is None:
                continue
            if value is None:
                view.entries.pop(key, None)
            else:
                view.entries[key] = value
    finally:
        consumer.close()
    return view
