"""Stream throughput with the data-operator chain on vs off (target: on/off >= 0.9).

Two real stream workers run on one broker, one with every built-in operator chained
(``reward_clip``, ``length_penalty``, ``overlong``, ``duplicate_responses``,
``zero_variance``), one with none. Rounds alternate between them, so both see the same
machine load; each round produces ``--records`` small records (old logits off, so the
figure is the pipeline's own cost) and measures records/s from the broker timestamps of
the first and last output (scored groups' samples plus filtered samples). Medians of
``--rounds`` rounds; the ratio is of medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path

from bench.streams import RUN, groups_of, output_span_s
from schemas.group import decode_group
from tests.support.streams import (
    WorkerProcess,
    create_stream_topics,
    keyed,
    produce,
    read_topic,
    stream_topics,
    worker_config,
)

CHAIN = (
    {"name": "reward_clip", "options": {"low": 0.0, "high": 1.0}},
    {"name": "length_penalty", "options": {"coef": 0.001}},
    {"name": "overlong"},
    {"name": "duplicate_responses"},
    {"name": "zero_variance"},
)
TARGET = 0.9


class Lane:
    """One worker and its topics."""

    def __init__(self, bootstrap: str, workdir: Path, name: str, operators: tuple) -> None:
        self.client = {"bootstrap.servers": bootstrap}
        self.topics = stream_topics(lambda base: f"bench-ops-{name}-{base}-{uuid.uuid4().hex[:6]}")
        create_stream_topics(self.client, self.topics, raw_partitions=4)
        config = worker_config(
            bootstrap,
            self.topics,
            f"bench-ops-{name}-{uuid.uuid4().hex[:6]}",
            run_id=RUN,
            old_logits={"mode": "off"},
            staleness={"max_staleness": 1000},
            operators=list(operators),
        )
        self.worker = WorkerProcess(config, workdir / name).start(loglevel="warn")
        self.first = 0

    def round(self, n_groups: int, size: int) -> float:
        """Records/s through the worker for ``n_groups`` new groups."""
        batch = groups_of(self.first, n_groups, size, 8, 16, 16, 1)
        self.first += n_groups
        ids = {g[0].group_id for g in batch}
        produce(self.client, self.topics["raw"], [keyed(t) for g in batch for t in g])
        outputs = [self.topics["scored"], self.topics["filtered"]]

        def samples(msgs: list) -> int:
            mine = [m for m in msgs if m.key().decode() in ids]
            return sum(
                len(decode_group(m.value()).samples) if m.topic() == outputs[0] else 1 for m in mine
            )

        msgs = read_topic(
            self.client, outputs, until=lambda m: samples(m) >= n_groups * size, timeout=900
        )
        mine = [m for m in msgs if m.key().decode() in ids]
        return (samples(mine) - size) / output_span_s(mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="Kafka host:port (default: an embedded broker)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=2000, help="records per round")
    parser.add_argument("--group-size", type=int, default=8)
    args, _ = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-dataops-") as scratch:
        workdir = Path(scratch)
        broker, bootstrap = None, args.bootstrap
        if bootstrap is None:
            from core.config import KafkaConfig, default_cache_dir
            from infra.kafka import EmbeddedKafka

            broker = EmbeddedKafka(KafkaConfig(), workdir / "kafka", default_cache_dir())
            bootstrap = broker.start()
        lanes = {
            "off": Lane(bootstrap, workdir, "off", ()),
            "on": Lane(bootstrap, workdir, "on", CHAIN),
        }
        rates: dict[str, list[float]] = {"off": [], "on": []}
        try:
            for lane in lanes.values():  # warm-up: topics assigned, first group through
                lane.round(2, args.group_size)
            for _ in range(args.rounds):
                for name, lane in lanes.items():
                    rates[name].append(lane.round(args.records // args.group_size, args.group_size))
                off, on = rates["off"][-1], rates["on"][-1]
                print(f"  round: off {off:,.0f} rec/s, on {on:,.0f} rec/s", flush=True)
        finally:
            for lane in lanes.values():
                lane.worker.stop()
            if broker is not None:
                broker.stop()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    verdict = "meets" if on / off >= TARGET else "MISSES"
    print(f"operators: chain on {on:,.0f} rec/s | off {off:,.0f} rec/s | ratio {on / off:.2f} "
          f"({verdict} the {TARGET} target)")  # fmt: skip


if __name__ == "__main__":
    main()
