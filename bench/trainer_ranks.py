"""Trainer ranks benchmark: world 2 against world 1 on the same records, from Kafka.

Run from the repository root: ``python -m bench.trainer_ranks [--steps N]``.

An embedded broker gets ``--groups`` scored groups of mixed lengths; ``rollstream``'s
trainer then trains ``--steps`` steps of ``--groups-per-step`` groups from them twice,
each time in its own consumer group: once as one process (``python -m consumers``), once
as two ranks under torch's launcher (``torchrun --nproc-per-node 2``, gloo), rank 0
feeding both (``consumers.ranks``). From the trainer's own metrics (steps after the first
two): waiting for data (``time/wait_s``: Kafka and batching), the step (``time/step_s``:
for world 2 handing the shares out and collecting the ranks' metrics, then forward,
backward, the gradient all-reduce and the optimiser, which DeepSpeed does not time apart
on the CPU), publishing (rank 0), tokens/s of the whole step and the token imbalance
between the ranks' shares.

On a 2-core machine two ranks of one torch thread each share the cores with the broker,
so only the breakdown and the overhead ratio mean something; on GPUs, every rank has its
own device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson

from core.config import KafkaConfig, default_cache_dir, to_toml
from infra.kafka import EmbeddedKafka
from infra.s3 import SeaweedServer, ensure_bucket
from schemas.group import encode_group
from weights.store import make_s3_client

REPO = Path(__file__).resolve().parents[1]


def produce_groups(bootstrap: str, topic: str, groups: int, seed: int) -> None:
    import dataclasses

    from confluent_kafka import Producer

    from infra.topics import ensure_topics
    from schemas.topics import ROLLOUTS_SCORED
    from tests.support.synthetic import scored_group, synthetic_groups

    client = {"bootstrap.servers": bootstrap}
    ensure_topics(client, [dataclasses.replace(ROLLOUTS_SCORED, name=topic)])
    short = synthetic_groups(groups // 2, seed=seed, run_id="bench", response_len=8)
    long = synthetic_groups(groups - groups // 2, seed=seed + 1, run_id="bench", response_len=24)
    producer = Producer(client)
    for group in [g for pair in zip(short, long, strict=False) for g in pair]:
        producer.produce(
            topic, key=group[0].group_id.encode(), value=encode_group(scored_group(group))
        )
    assert producer.flush(30) == 0


def run_world(
    world: int, bootstrap: str, s3: dict, topic: str, args: argparse.Namespace, workdir: Path
) -> list[dict[str, float]]:
    run = workdir / f"world{world}"
    run.mkdir()
    trainer = {
        "engine": {"lr": 1e-3, "zero_stage": 1, "bf16": False},
        "batch": {"max_groups": args.groups_per_step, "max_wait_s": 30.0},
        "topics": {"scored": topic, "group_id": f"bench-ranks-{world}-{uuid.uuid4().hex[:6]}"},
        "checkpoint": {"dir": str(run / "ckpt"), "every": 10_000},
        "metrics_file": str(run / "metrics.jsonl"),
        "progress": False,
        "staleness": {"max_staleness": 1000},
        "max_steps": args.steps,
    }
    config = run / "rollstream.toml"
    config.write_text(
        to_toml(
            {
                "run_id": "bench",
                "kafka": {"bootstrap_servers": bootstrap},
                "s3": {**s3, "bucket": f"{s3['bucket']}-{world}"},  # a store per world
                "trainer": trainer,
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "consumers"]
    if world > 1:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", "-m", "consumers",
        ]  # fmt: skip
    with (run / "log.txt").open("wb") as log:
        code = subprocess.call([*launcher, "--config", str(config)], cwd=REPO, env=env,
                               stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    if code != 0:
        raise SystemExit(f"world {world} failed ({code}): see {run / 'log.txt'}")
    return [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]


def median(rows: list[dict[str, float]], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=8)
    args = parser.parse_args()
    groups = args.steps * args.groups_per_step
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as scratch:
        workdir = Path(scratch)
        broker = EmbeddedKafka(KafkaConfig(), workdir / "kafka", default_cache_dir())
        bootstrap = broker.start()
        store = SeaweedServer(workdir / "s3")
        store.start()
        try:
            s3 = store.config(bucket="bench-ranks")
            for world in (1, 2):
                ensure_bucket(make_s3_client(s3), f"{s3.bucket}-{world}")
            s3_table = s3.file_table()
            topic = f"bench.ranks.scored.{uuid.uuid4().hex[:6]}"
            produce_groups(bootstrap, topic, groups, seed=5)
            results = {
                world: run_world(world, bootstrap, s3_table, topic, args, workdir)[2:]
                for world in (1, 2)
            }
        finally:
            store.stop()
            broker.stop()
    print(
        f"# bench.trainer_ranks {datetime.now(UTC):%Y-%m-%d} tiny model, {args.steps} steps "
        f"of {args.groups_per_step} groups (responses of 8 and 24 tokens), medians of steps "
        f"3-{args.steps}; 2 shared cores"
    )
    print(f"{'':24} {'world 1':>10} {'world 2':>10} {'ratio':>7}")
    for label, key in (
        ("wait for data (s)", "time/wait_s"),
        ("step (s)", "time/step_s"),
        ("publish (s)", "time/publish_s"),
        ("tokens/s", "throughput/tokens_per_s"),
    ):
        one, two = median(results[1], key), median(results[2], key)
        print(f"{label:24} {one:10.3f} {two:10.3f} {two / one:7.2f}")
    print(f"{'token imbalance':24} {'':>10} {median(results[2], 'ranks/token_imbalance'):10.3f}")


if __name__ == "__main__":
    main()
