"""Stream benchmark: old-logit throughput and pipeline overhead of the Faust worker.

Run from the repository root: ``python -m bench.streams [--bootstrap host:port]``
(without ``--bootstrap`` an embedded Kafka broker is started in a temporary directory).

1. **Old-logit tokens/s.** Groups of ``--group-size`` samples (prompt ``--prompt``,
   response ``--response`` tokens, one two-segment partial rollout per group) go through a
   real worker (``python -m streams.faust.app worker``, exact old logits, versions from the
   seeded source, ``--model``). Throughput is response tokens per second between the
   first and the last scored group of a round (broker timestamps of the worker's
   outputs), so worker start-up and snapshot building are not counted; every group in
   between was consumed, validated, stored, scored and emitted. The baseline runs the
   same forward passes (same batches: per group, per version, ``max_batch_sequences``)
   in process with ``core.logprobs.response_logprobs``, nothing else. Target:
   stream / bare ≥ 0.7.
2. **Pipeline overhead.** Small records, old logits off: records/s through
   validate → filter → group → emit (exactly-once, table changelog), against a plain
   confluent-kafka consume + produce loop (at-least-once, no processing) over the same
   records, in the same run.

Each figure is the median over ``--rounds`` rounds; ratios are of medians. Both sides use
one torch thread. On a shared 2-core machine, expect noise of ±10%.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from core.logprobs import response_logprobs
from core.models import load_model, parse_model_spec
from core.process import free_port
from schemas.group import decode_group
from schemas.trajectory import Trajectory
from streams.oldlogits import plan_batches, segment_units
from streams.snapshots import SeededSource
from tests.support.streams import (
    WorkerProcess,
    create_stream_topics,
    keyed,
    produce,
    read_topic,
    stream_topics,
    synthetic,
    worker_config,
)

RUN = "bench"
BENCH_MODEL = (
    "tiny:hidden_size=256,num_layers=4,num_heads=4,intermediate_size=1024,"
    "max_positions=512,vocab_size=512"
)
TARGET = 0.7


def groups_of(
    first: int, count: int, size: int, prompt: int, response: int, vocab: int, versions: int
) -> list[list[Trajectory]]:
    """``count`` groups; group g is generated under version g % versions, its last sample
    switching to the next version halfway (a partial rollout)."""
    out = []
    for g in range(first, first + count):
        v = g % versions
        samples = [
            synthetic(
                run_id=RUN,
                group_id=f"g{g:05d}",
                group_size=size,
                sample_index=i,
                versions=(v, v + 1) if i == size - 1 else (v,),
                prompt_len=prompt,
                response_len=response,
                vocab=vocab,
                seed=g * 1000 + i,
            )
            for i in range(size)
        ]
        out.append(samples)
    return out


def tokens(groups: Sequence[Sequence[Trajectory]]) -> int:
    return sum(t.num_response_tokens for group in groups for t in group)


def output_span_s(msgs: list) -> float:
    stamps = sorted(m.timestamp()[1] for m in msgs)
    return (stamps[-1] - stamps[0]) / 1000


# --- 1. old-logit throughput ------------------------------------------------------------


def bare_tokens_per_s(
    groups: list[list[Trajectory]], model, states: dict, max_sequences: int, max_tokens: int
) -> float:
    """Forward passes only, batched as the stream batches them; groups[1:] are timed (the
    stream's figure also starts at its first emitted group)."""
    elapsed = 0.0
    for index, samples in enumerate(groups):
        units = segment_units(samples)
        started = time.perf_counter()
        for version in sorted({u.version for u in units}):
            mine = [u for u in units if u.version == version]
            for batch in plan_batches(mine, samples, max_sequences, max_tokens):
                pairs = [
                    (samples[u.row].prompt_ids, samples[u.row].response_ids[: u.end]) for u in batch
                ]
                response_logprobs(model, pairs, torch.float32, state=states[version])
        if index:
            elapsed += time.perf_counter() - started
    return tokens(groups[1:]) / elapsed


def run_oldlogits(args: argparse.Namespace, bootstrap: str, workdir: Path) -> tuple[float, float]:
    client = {"bootstrap.servers": bootstrap}
    topics = stream_topics(lambda base: f"bench-{base}-{uuid.uuid4().hex[:6]}")
    create_stream_topics(client, topics, raw_partitions=4)
    vocab = parse_model_spec(args.model).tiny_kwargs.get("vocab_size", 16)
    versions = 4
    old = {
        "mode": "exact",
        "source": "seeded",
        "model": args.model,
        "max_batch_sequences": args.group_size,
        "snapshot_memory_mb": 4096,
    }
    port = free_port()
    config = worker_config(
        bootstrap,
        topics,
        f"bench-{uuid.uuid4().hex[:6]}",
        run_id=RUN,
        old_logits=old,
        staleness={"max_staleness": 1000},
        validation={"vocab_size": vocab},
        metrics_port=port,
    )
    worker = WorkerProcess(config, workdir / "oldlogits").start(loglevel="warn")
    model = load_model(args.model)
    source = SeededSource(args.model)
    states = {v: source.load(v) for v in range(versions + 1)}
    max_tokens = 16_384
    stream_rates: list[float] = []
    bare_rates: list[float] = []
    inside: list[float] = []  # the worker's own forward passes, from its metrics
    try:
        # warm-up round: the worker builds every version's snapshot
        warm = groups_of(
            0, versions + 1, args.group_size, args.prompt, args.response, vocab, versions
        )
        produce(client, topics["raw"], [keyed(t) for g in warm for t in g])
        seen = len(warm)
        read_topic(client, [topics["scored"]], until=lambda m: len(m) >= seen, timeout=600)
        first = len(warm)
        seen_tokens, seen_s = forward_counters(port)
        for _ in range(args.rounds):
            batch = groups_of(
                first, args.groups, args.group_size, args.prompt, args.response, vocab, versions
            )
            first += args.groups
            ids = {g[0].group_id for g in batch}
            produce(client, topics["raw"], [keyed(t) for g in batch for t in g])
            msgs = read_topic(
                client,
                [topics["scored"]],
                until=lambda m, ids=ids: (
                    sum(decode_group(x.value()).group_id in ids for x in m) >= len(ids)
                ),
                timeout=900,
            )
            mine = [m for m in msgs if decode_group(m.value()).group_id in ids]
            assert all(
                s.old_logits_status == "exact"
                for m in mine
                for s in decode_group(m.value()).samples
            )
            order = {
                decode_group(m.value()).group_id: i
                for i, m in enumerate(sorted(mine, key=lambda m: m.timestamp()[1]))
            }
            in_order = sorted(batch, key=lambda g: order[g[0].group_id])
            stream_rates.append(tokens(in_order[1:]) / output_span_s(mine))
            done_tokens, done_s = forward_counters(port)
            inside.append((done_tokens - seen_tokens) / (done_s - seen_s))
            seen_tokens, seen_s = done_tokens, done_s
            bare_rates.append(
                bare_tokens_per_s(in_order, model, states, args.group_size, max_tokens)
            )
            print(
                f"  round: stream {stream_rates[-1]:,.0f} tok/s, bare {bare_rates[-1]:,.0f} tok/s",
                flush=True,
            )
    finally:
        worker.stop()
    print(f"  (forward passes inside the worker: {statistics.median(inside):,.0f} tok/s)")
    return statistics.median(stream_rates), statistics.median(bare_rates)


def forward_counters(port: int) -> tuple[float, float]:
    """The worker's ``oldlogit_tokens_total`` and ``oldlogit_seconds_total``."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("rollstream_streams_oldlogit_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return (
        values.get("rollstream_streams_oldlogit_tokens_total", 0.0),
        values.get("rollstream_streams_oldlogit_seconds_total", 0.0),
    )


# --- 2. pipeline overhead ---------------------------------------------------------------


def plain_loop_records_per_s(client: dict, source: str, sink: str, expected: int) -> float:
    """Consume every record of ``source`` and produce it unchanged to ``sink``."""
    from confluent_kafka import Consumer, Producer

    consumer = Consumer(
        {
            **client,
            "group.id": f"plain-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    producer = Producer({**client, "linger.ms": 5})
    consumer.subscribe([source])
    done = 0
    try:
        while done < expected:
            for msg in consumer.consume(num_messages=500, timeout=1.0):
                if msg.error():
                    continue
                while True:
                    try:
                        producer.produce(
                            sink, key=msg.key(), value=msg.value(), headers=msg.headers()
                        )
                        break
                    except BufferError:
                        producer.poll(0.05)
                producer.poll(0)
                done += 1
            if done:
                consumer.commit(asynchronous=True)
        producer.flush(60)
    finally:
        consumer.close()
    # Same measure as the stream's: output records between the first and the last.
    out = read_topic(client, [sink], until=lambda m: len(m) >= expected, timeout=300)
    return (len(out) - 1) / output_span_s(out)


def run_pipeline(args: argparse.Namespace, bootstrap: str, workdir: Path) -> tuple[float, float]:
    from infra.topics import ensure_topics
    from schemas.topics import TopicSpec

    client = {"bootstrap.servers": bootstrap}
    topics = stream_topics(lambda base: f"benchp-{base}-{uuid.uuid4().hex[:6]}")
    create_stream_topics(client, topics, raw_partitions=4)
    config = worker_config(
        bootstrap,
        topics,
        f"benchp-{uuid.uuid4().hex[:6]}",
        run_id=RUN,
        old_logits={"mode": "off"},
        staleness={"max_staleness": 1000},
    )
    worker = WorkerProcess(config, workdir / "pipeline").start(loglevel="warn")
    size = args.group_size
    n_groups = args.records // size
    stream_rates: list[float] = []
    plain_rates: list[float] = []
    first = 0
    try:
        warm = groups_of(0, 4, size, 8, 16, 16, 1)
        produce(client, topics["raw"], [keyed(t) for g in warm for t in g])
        read_topic(client, [topics["scored"]], until=lambda m: len(m) >= 4, timeout=300)
        first = len(warm)
        for _ in range(args.rounds):
            batch = groups_of(first, n_groups, size, 8, 16, 16, 1)
            first += n_groups
            ids = {g[0].group_id for g in batch}
            records = [keyed(t) for g in batch for t in g]
            produce(client, topics["raw"], records)
            msgs = read_topic(
                client,
                [topics["scored"]],
                until=lambda m, ids=ids: sum(x.key().decode() in ids for x in m) >= len(ids),
                timeout=900,
            )
            mine = [m for m in msgs if m.key().decode() in ids]
            stream_rates.append((len(mine) - 1) * size / output_span_s(mine))

            source, sink = f"plain-in-{uuid.uuid4().hex[:6]}", f"plain-out-{uuid.uuid4().hex[:6]}"
            ensure_topics(client, [TopicSpec(source, 4), TopicSpec(sink, 1)])
            produce(client, source, records)
            plain_rates.append(plain_loop_records_per_s(client, source, sink, len(records)))
            print(
                f"  round: stream {stream_rates[-1]:,.0f} rec/s, "
                f"plain loop {plain_rates[-1]:,.0f} rec/s",
                flush=True,
            )
    finally:
        worker.stop()
    return statistics.median(stream_rates), statistics.median(plain_rates)


# --- main -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="Kafka host:port (default: start an embedded broker)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=16, help="groups per old-logit round")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--model", default=BENCH_MODEL, help="A tiny model spec (core.models).")
    parser.add_argument("--records", type=int, default=4000, help="records per pipeline round")
    parser.add_argument("--skip", choices=["oldlogits", "pipeline"], action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench-streams-") as scratch:
        workdir = Path(scratch)
        broker = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            from core.config import KafkaConfig, default_cache_dir
            from infra.kafka import EmbeddedKafka

            broker = EmbeddedKafka(KafkaConfig(), workdir / "kafka", default_cache_dir())
            bootstrap = broker.start()
        try:
            if "oldlogits" not in args.skip:
                print(
                    f"old-logit throughput ({args.model}, groups of {args.group_size}, "
                    f"prompt {args.prompt} + response {args.response} tokens):",
                    flush=True,
                )
                stream, bare = run_oldlogits(args, bootstrap, workdir)
                ratio = stream / bare
                verdict = "meets" if ratio >= TARGET else "MISSES"
                print(
                    f"old logits: stream {stream:,.0f} tok/s | bare forward {bare:,.0f} tok/s | "
                    f"ratio {ratio:.2f} ({verdict} the {TARGET} target)"
                )
            if "pipeline" not in args.skip:
                print(
                    f"pipeline overhead (old logits off, {args.records} records of "
                    f"8+16 tokens per round):",
                    flush=True,
                )
                stream, plain = run_pipeline(args, bootstrap, workdir)
                print(
                    f"pipeline: stream {stream:,.0f} rec/s | plain consume+produce "
                    f"{plain:,.0f} rec/s | ratio {stream / plain:.2f}"
                )
        finally:
            if broker is not None:
                broker.stop()


if __name__ == "__main__":
    main()
