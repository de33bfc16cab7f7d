"""Records for tests and benchmarks: rollouts sampled from a tiny model under given versions.

``rollout`` samples a response segment by segment, each segment under its own version's
weights (a partial rollout that saw weight updates), and records the sampler's log-probs
as ``logp_infer`` (optionally perturbed, to mimic an inference engine whose numerics
differ from the trainer's). ``synthetic`` makes a valid record without a model.

``WorkerProcess`` runs a real stream worker in a subprocess and the readers below look at
what it produced, on a real broker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.config import to_toml
from core.prefork import ForkedRole
from core.topic_reader import end_offsets
from schemas.codec import encode
from schemas.control import DeadLetter
from schemas.topics import ROLLOUTS_SCORED, value_room
from schemas.trajectory import Trajectory
from streams.config import StreamsConfig
from streams.oldlogits import OldLogitEngine
from streams.processor import Message, Processor, Step
from streams.staleness import VersionTracker

from .forked_roles import start_role
from .paths import REPO, TESTS  # relative: bench imports this module as tests.support.streams


@dataclass(frozen=True)
class RecordLabels:
    """The ids and reward a test record carries (``group_id`` None: a fresh one; ``reward``
    None: a random one from the record's seed)."""

    run_id: str = "run"
    group_id: str | None = None
    group_size: int = 1
    sample_index: int = 0
    reward: float | None = None


def rollout(
    model: Any,
    states: Mapping[int, Mapping[str, Any]],
    prompt: Sequence[int],
    segments: Sequence[tuple[int, int]],
    *,
    seed: int = 0,
    temperature: float = 1.0,
    infer_noise: float = 0.0,
    labels: RecordLabels = RecordLabels(),
) -> Trajectory:
    """A trajectory whose segment ``k`` has ``segments[k] = (version, length)`` tokens
    sampled under ``states[version]``."""
    rng = np.random.default_rng(seed)
    response, logps = _sample_segments(model, states, prompt, segments, seed, temperature)
    logp_infer = np.asarray(logps, np.float32)
    if infer_noise:
        logp_infer = np.minimum(logp_infer + rng.normal(0, infer_noise, len(logps)), 0.0)
    group_id = labels.group_id or uuid.uuid4().hex
    return Trajectory.create(
        run_id=labels.run_id,
        trajectory_id=f"{group_id}-{labels.sample_index}",
        group_id=group_id,
        group_size=labels.group_size,
        sample_index=labels.sample_index,
        producer_id="test-producer",
        region="local",
        task="test",
        prompt_ids=list(prompt),
        response_ids=response,
        logp_infer=logp_infer,
        segment_versions=[v for v, _ in segments],
        segment_lengths=[n for _, n in segments],
        reward=float(rng.random() if labels.reward is None else labels.reward),
        reward_details={},
        finish_reason="length",
        created_at_ms=1_000,
        finished_at_ms=2_000,
    )


def _sample_segments(
    model: Any,
    states: Mapping[int, Mapping[str, Any]],
    prompt: Sequence[int],
    segments: Sequence[tuple[int, int]],
    seed: int,
    temperature: float,
) -> tuple[list[int], list[float]]:
    """The response tokens sampled segment by segment under each segment's weights, and
    the sampler's log-prob of each."""
    import torch

    from core.logprobs import params_for

    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    ids = [int(t) for t in prompt]
    response: list[int] = []
    logps: list[float] = []
    for version, length in segments:
        params = params_for(model, states[version], dtype)
        for _ in range(length):
            with torch.inference_mode():
                logits = torch.func.functional_call(
                    model, params, (), {"input_ids": torch.tensor([ids])}, strict=False
                ).logits[0, -1]
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(token)
            response.append(token)
            logps.append(float(logp[token]))
    return response, logps


@dataclass(frozen=True)
class SyntheticRecord:
    """A valid record with random tokens (no model): for routing and assembly tests.

    The response is split evenly over ``versions`` (the last segment takes the rest);
    tokens are drawn below ``vocab`` from ``seed`` (default: the sample index)."""

    run_id: str = "run"
    group_id: str = "g"
    group_size: int = 4
    sample_index: int = 0
    versions: Sequence[int] = (0,)
    prompt_len: int = 4
    response_len: int = 6
    reward: float | None = None
    seed: int | None = None
    vocab: int = 16

    def trajectory(self) -> Trajectory:
        rng = np.random.default_rng(self.seed if self.seed is not None else self.sample_index)
        n = len(self.versions)
        lengths = [self.response_len // n] * (n - 1)
        lengths.append(self.response_len - sum(lengths))
        return Trajectory.create(
            run_id=self.run_id,
            trajectory_id=f"{self.group_id}-{self.sample_index}",
            group_id=self.group_id,
            group_size=self.group_size,
            sample_index=self.sample_index,
            producer_id="test-producer",
            region="local",
            task="test",
            prompt_ids=rng.integers(0, self.vocab, self.prompt_len),
            response_ids=rng.integers(0, self.vocab, self.response_len),
            logp_infer=-rng.exponential(1.0, self.response_len),
            segment_versions=list(self.versions),
            segment_lengths=lengths,
            reward=float(rng.random() if self.reward is None else self.reward),
            reward_details={"seed": int(self.sample_index)},
            finish_reason="stop",
            created_at_ms=1_000,
            finished_at_ms=2_000,
        )


def synthetic(**fields: Any) -> Trajectory:
    """``SyntheticRecord(**fields).trajectory()``: the keyword arguments are its fields."""
    return SyntheticRecord(**fields).trajectory()


# --- running workers and reading topics (tests and benchmarks) --------------------------


def synthetic_group(run_id: str, group_id: str, rewards: Sequence[float]) -> list[Trajectory]:
    """One group of ``len(rewards)`` valid records, sample ``i`` with reward ``rewards[i]``;
    the same group id gives the same records."""
    import zlib

    return [
        synthetic(
            run_id=run_id,
            group_id=group_id,
            group_size=len(rewards),
            sample_index=i,
            reward=r,
            seed=zlib.crc32(group_id.encode()) + i,
        )
        for i, r in enumerate(rewards)
    ]


class WorkerProcess:
    """A stream worker in a process of its own: ``rollstream stream --no-supervisor`` (or,
    supervised, ``rollstream stream``) with a TOML config written to ``workdir``, forked
    (``forked_roles``); its output goes to ``workdir/<name>.log``."""

    def __init__(
        self,
        config: Mapping[str, Any],
        workdir: Path,
        name: str = "worker",
        *,
        supervised: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: more environment variables for the worker (a failpoint)."""
        self.config = config
        self.supervised = supervised
        self.env = dict(env or {})
        self.workdir = Path(workdir)
        self.name = name
        self.process: ForkedRole | None = None
        self.log_path = self.workdir / f"{name}.log"

    def start(self, loglevel: str = "info") -> WorkerProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / f"{self.name}.toml"
        config_path.write_text(to_toml(self.config))
        env = dict(os.environ, ROLLSTREAM_CONFIG=str(config_path), PYTHONUNBUFFERED="1")
        env.update(self.env)
        # user code the tests name by dotted path (``support.user_operators``) is importable
        tests_dir = str(TESTS)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
        if self.supervised:  # the user's command: a supervisor restarts crashed workers
            argv = [sys.executable, "-m", "rollstream", "stream", "-l", loglevel]
            argv.append(f"--datadir={self.workdir / 'data'}")
        else:
            argv = [sys.executable, "-m", "rollstream", "stream", "--no-supervisor"]
            argv += [f"--datadir={self.workdir / 'data'}", "-l", loglevel]
        self.process = start_role(argv, env, self.log_path, cwd=REPO)  # forked, see forked_roles
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def read_topic(
    client_config: Mapping[str, str],
    topics: Sequence[str],
    *,
    until: Any = None,
    timeout: float = 60.0,
    check: Any = None,
) -> list[Any]:
    """Every committed message of ``topics`` from the start, polled until ``until(msgs)``
    is true (or, without ``until``, until the end offsets seen at the start are reached).
    ``check()`` runs every poll (e.g. assert the worker lives).

    Raises ``TimeoutError`` when ``timeout`` passes first: a test that waits for an
    output (or a kill point) never goes on without it."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            **client_config,
            "group.id": f"read-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    short = _end_offsets(client_config, topics)  # partitions not read to their end yet
    consumer.subscribe(list(topics))
    found: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if check is not None:
                check()
            _take(consumer.consume(num_messages=500, timeout=0.5), found, short)
            if until is not None and until(found):
                return found
            if until is None:
                _drop_passed(consumer, short)
                if not short:
                    return found
    finally:
        consumer.close()
    if until is not None:
        raise TimeoutError(f"{list(topics)}: condition not met in {timeout}s ({len(found)} read)")
    raise TimeoutError(
        f"{list(topics)}: partitions {sorted(short)} not read to their end offsets "
        f"{[short[k] for k in sorted(short)]} in {timeout}s ({len(found)} read)"
    )


def _end_offsets(
    client_config: Mapping[str, str], topics: Sequence[str]
) -> dict[tuple[str, int], int]:
    """The high watermark of every partition of ``topics`` that holds records now (a leader
    still being elected on a loaded broker is waited for)."""
    return {
        (topic, p): high
        for topic in topics
        for p, high in end_offsets(client_config, topic, timeout=60).items()
        if high > 0
    }


def _take(messages: list[Any], found: list[Any], short: dict[tuple[str, int], int]) -> None:
    """Keep the records of ``messages`` in ``found``; a partition whose record or
    end-of-partition reaches its end offset leaves ``short``."""
    from confluent_kafka import KafkaError

    for msg in messages:
        key, offset = (msg.topic(), msg.partition()), msg.offset()
        err = msg.error()
        if err is None:
            found.append(msg)
            offset += 1
        elif err.code() != KafkaError._PARTITION_EOF:
            continue
        if key in short and offset >= short[key]:
            del short[key]


def _drop_passed(consumer: Any, short: dict[tuple[str, int], int]) -> None:
    """Partitions whose position passed their end offset leave ``short``: past trailing
    transaction markers without a record."""
    from confluent_kafka import TopicPartition

    positions = consumer.position([TopicPartition(t, p) for t, p in short])
    for tp in positions:
        if tp.offset >= short[(tp.topic, tp.partition)]:
            del short[(tp.topic, tp.partition)]


def committed_offsets(client_config: Mapping[str, str], group: str, topic: str) -> dict[int, int]:
    """The consumer group's committed offset per partition of ``topic`` (-1001: none),
    retried while the group's coordinator moves or loads."""
    from confluent_kafka import Consumer, TopicPartition

    from core.topic_reader import committed_offsets as group_committed

    consumer = Consumer({**client_config, "group.id": group, "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        found = group_committed(consumer, [TopicPartition(topic, p) for p in partitions])
        return {tp.partition: tp.offset for tp in found}
    finally:
        consumer.close()


def applied_offsets(
    client_config: Mapping[str, str],
    app_id: str,
    topic: str,
    partitions: Iterable[int] | None = None,
) -> dict[int, int]:
    """The last offset per partition of ``topic`` (all of them, or ``partitions``) whose
    effects the stream app's table holds (its committed changelog's watermarks): what the
    app has really applied, where Faust's committed offsets are only a hint
    (``streams.faust.gaps``)."""
    from streams.faust.table_view import read_table

    if partitions is None:
        partitions = end_offsets(client_config, topic)
    return read_table(client_config, app_id).applied(topic, list(partitions))


def all_applied(client_config: Mapping[str, str], app_id: str, topic: str) -> bool:
    """Every record of ``topic`` so far has been applied by the stream app."""
    ends = end_offsets(client_config, topic)
    done = applied_offsets(client_config, app_id, topic, ends)
    return all(done.get(p, -1) >= end - 1 for p, end in ends.items() if end > 0)


def wait_until(predicate: Any, timeout: float, what: str, check: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def stream_topics(name: Any) -> dict[str, str]:
    """Topic names for one test or benchmark run; ``name("raw")`` must be unique."""
    keys = ("raw", "scored", "stale", "dlq", "filtered", "prompt_stats", "versions")
    return {key: name(key) for key in keys}


def create_stream_topics(
    client_config: Mapping[str, str], topics: Mapping[str, str], raw_partitions: int = 4
) -> None:
    """The worker's topics under the test's names, each as its spec declares it (sizes,
    compaction), one partition each but raw's ``raw_partitions``."""
    import dataclasses

    from infra.topics import ensure_topics
    from schemas import topics as declared

    spec_of = {
        "raw": declared.ROLLOUTS_RAW,
        "scored": declared.ROLLOUTS_SCORED,
        "stale": declared.ROLLOUTS_STALE,
        "dlq": declared.ROLLOUTS_DLQ,
        "filtered": declared.ROLLOUTS_FILTERED,
        "versions": declared.POLICY_VERSIONS,
        "prompt_stats": declared.PROMPTS_STATS,
    }
    specs = [
        dataclasses.replace(
            spec, name=topics[key], partitions=raw_partitions if key == "raw" else 1
        )
        for key, spec in spec_of.items()
        if key in topics
    ]
    ensure_topics(client_config, specs)


def worker_config(
    bootstrap_servers: str,
    topics: Mapping[str, str],
    app_id: str,
    *,
    run_id: str,
    s3: Any = None,
    weights: Mapping[str, Any] | None = None,
    kafka: Mapping[str, Any] | None = None,
    **streams: Any,
) -> dict[str, Any]:
    """A whole config file (as a dict) for ``WorkerProcess``; ``streams`` are
    ``[streams]`` keys, ``s3`` an ``S3Config`` (its secret written out), ``kafka`` more
    ``[kafka]`` keys (security settings). Unsigned versions are allowed unless
    ``weights`` says otherwise (these tests' writers do not sign)."""
    config: dict[str, Any] = {
        "run_id": run_id,
        "kafka": {"bootstrap_servers": bootstrap_servers, **(kafka or {})},
        "streams": {"app_id": app_id, "topics": dict(topics), "commit_interval_s": 0.5, **streams},
        "weights": {"allow_unsigned": True, **(weights or {})},
    }
    if s3 is not None:
        config["s3"] = s3.file_table()
    return config


def keyed(traj: Trajectory) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """``(key, value, headers)`` as a producer sends ``traj`` on ``rollouts.raw``."""
    from schemas.codec import encode, routing_headers

    return traj.group_id.encode(), encode(traj), routing_headers(traj)


def produce(
    client_config: Mapping[str, str],
    topic: str,
    records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]],
) -> None:
    """Produce ``(key, value, headers)`` records and wait for every acknowledgement."""
    from confluent_kafka import Producer

    producer = Producer({**client_config, "linger.ms": 5})
    for key, value, headers in records:
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=list(headers))
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    if producer.flush(60) != 0:
        raise RuntimeError(f"{topic}: records not acknowledged within 60 s")


RUN = "run"
RAW = "rollouts.raw"


class Harness:
    """A processor over a dict table, applying each step the way ``streams.faust.txn`` does."""

    def __init__(self, *, model: tuple[int, int] | None = None, **config) -> None:
        """``model``: the (vocab size, context) of the old-logit model."""
        self.config = StreamsConfig.model_validate({"old_logits": {"mode": "off"}, **config})
        self.table: dict[bytes, bytes] = {}
        self.tracker = VersionTracker()
        vocab, context = model if model is not None else (None, None)
        self.processor = Processor(
            self.config,
            RUN,
            self.tracker,
            self.table,
            model_vocab_size=vocab,
            model_context=context,
        )
        self.engine = OldLogitEngine(self.config.old_logits, None)
        self.sent: list = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.now = 1_000_000

    def feed(
        self, value: bytes | None, key: bytes | None = None, partition: int = 0, topic: str = RAW
    ) -> Step:
        offset = self.offsets.get((topic, partition), -1) + 1
        self.offsets[(topic, partition)] = offset
        return self.deliver(Message(topic, partition, offset, key, value, (("x-h", b"1"),)))

    def deliver(self, msg: Message) -> Step:
        """As the worker's agent does: old logits per emitted group, a failure failing
        that group alone."""
        step = self.processor.handle(msg, self.now)
        attached, failed = {}, {}
        for closing in step.closings:
            if closing.emit:
                try:
                    attached[closing.state.group_id] = self.engine.attach(closing.samples)
                except Exception as err:
                    failed[closing.state.group_id] = repr(err)
        self.processor.finish(step, attached, self.now, failed)
        for send in step.sends:
            self.sent.append(send)
        for key, value in step.writes:
            if value is None:
                self.table.pop(key, None)
            else:
                self.table[key] = value
        return step

    def sample(self, **kw) -> Step:
        traj = synthetic(run_id=RUN, **kw)
        return self.feed(encode(traj), traj.group_id.encode())

    def tick(self, partition: int = 0) -> Step:
        return self.feed(b"", None, partition, topic=self.config.ticks_topic)

    def on(self, topic: str) -> list:
        return [s for s in self.sent if s.topic == topic]

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter.from_headers(s.headers) for s in self.on("rollouts.dlq")]


FILLING = {"validation": {"max_response_tokens": 10**6}, "prompt_stats": {"enabled": False}}
"""Stream settings that let ``filling_tokens``'s samples through."""


def filling_tokens(group_id: str) -> tuple[int, int]:
    """A response length whose group of 5 samples (``synthetic``, run ``RUN``, settings
    ``FILLING``) encodes to a scored value within 40 bytes under the scored topic's
    ``max.message.bytes``, and the room that topic leaves such a group's value."""
    probe = Harness(**FILLING)
    for i in range(5):
        probe.sample(group_id=group_id, group_size=5, sample_index=i, response_len=1000)
    (small,) = probe.on("rollouts.scored")
    # Each response token is 8 bytes (id and log-prob) in each of the 5 samples.
    tokens = 1000 + (ROLLOUTS_SCORED.max_message_bytes - len(small.value)) // 40
    return tokens, value_room(ROLLOUTS_SCORED, small.key, small.headers)
