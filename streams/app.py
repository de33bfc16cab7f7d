"""The stream worker's Faust app: ``build_app`` wires it, ``run_worker`` runs it
(``rollstream stream``).

Reads top to bottom: configuration, the app, its topics and table, the services the
agent uses, then the agent and the timers. The decisions live in plain modules
(``streams.processor``, ``.oldlogits``, ``.snapshots``, ``.staleness``); this file only
wires them to Kafka. Configuration is passed in: the ``[streams]`` section and the shared
sections (Kafka, S3, weights).

Per message on ``rollouts.raw`` (keyed by group id): decode, validate, staleness check,
add to the group's table entry; when the group is complete (or every sample is
accounted for), compute exact old logits in a one-thread executor — never on the event
loop, so heartbeats and commits go on — and emit the ``ScoredGroup``. A timer sends
*ticks* to the partitions holding overdue groups (the internal ticks topic is
co-partitioned with raw), so timeouts close groups inside the same per-partition
transactions as everything else (``streams.txn`` explains the exactly-once argument).
A second timer sweeps for records Faust fetched but never handed to the agent
(``streams.gaps``).

Scaling out: start more workers with the same ``app_id``. Faust's assignor gives each
worker whole partitions of raw, ticks and the table changelog together (a group never
spans workers), and each worker runs its own forward passes: old-logit compute scales
with the number of workers up to the raw partition count (8), as long as each worker
has its own cores (set ``old_logits.torch_threads`` to the cores per worker). Each worker
holds its own snapshot store, so memory for snapshots grows with the worker count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import faust
import torch
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from faust.types import TP

from core.config import SharedConfig
from core.presence import Beacon, default_instance
from core.topic_reader import group_lag, member_of
from infra.topics import ensure_topics
from schemas.topics import (
    POLICY_VERSIONS,
    PROMPTS_STATS,
    ROLLOUTS_DLQ,
    ROLLOUTS_FILTERED,
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    ROLLOUTS_STALE,
    TopicSpec,
)
from streams.broker import broker_credentials, broker_urls
from streams.config import StreamsConfig
from streams.faust_logs import quiet_commit_alarms
from streams.gaps import GAP_SWEEP_INTERVAL_S, GapGuard
from streams.metrics import StreamMetrics
from streams.oldlogits import OldLogitEngine, model_limits
from streams.processor import Message, Processor, Step
from streams.restore import read_changelog_partition
from streams.snapshots import FollowerFeed, FollowerSource, SeededSource, SnapshotStore
from streams.staleness import StalenessPolicy, VersionTracker
from streams.txn import EffectWriter, check_faust_internals, mirror_writes
from streams.versions import VersionReader
from weights.announce import AnnouncementListener

log = logging.getLogger("streams")


def prepare_topics(kafka: dict[str, str], config: StreamsConfig) -> int:
    """Create missing topics; the ticks topic gets raw's partition count. Returns it."""
    present = AdminClient(kafka).list_topics(timeout=30).topics
    if config.topics.raw in present:
        partitions = len(present[config.topics.raw].partitions)
    else:
        partitions = ROLLOUTS_RAW.partitions
    renamed = [
        TopicSpec(config.topics.raw, partitions),
        TopicSpec(
            config.topics.scored, ROLLOUTS_SCORED.partitions, max_message_bytes=16 * 1024 * 1024
        ),
        TopicSpec(
            config.topics.stale,
            ROLLOUTS_STALE.partitions,
            retention_ms=ROLLOUTS_STALE.retention_ms,
        ),
        TopicSpec(
            config.topics.dlq,
            ROLLOUTS_DLQ.partitions,
            retention_ms=ROLLOUTS_DLQ.retention_ms,
            max_message_bytes=ROLLOUTS_DLQ.max_message_bytes,
        ),
        TopicSpec(
            config.topics.filtered,
            ROLLOUTS_FILTERED.partitions,
            retention_ms=ROLLOUTS_FILTERED.retention_ms,
            max_message_bytes=ROLLOUTS_FILTERED.max_message_bytes,
        ),
        TopicSpec(
            config.topics.prompt_stats,
            PROMPTS_STATS.partitions,
            cleanup_policy="compact",
            max_message_bytes=PROMPTS_STATS.max_message_bytes,
            extra_configs=PROMPTS_STATS.extra_configs,
        ),
        TopicSpec(
            config.topics.versions,
            POLICY_VERSIONS.partitions,
            cleanup_policy="compact",
            max_message_bytes=POLICY_VERSIONS.max_message_bytes,
            extra_configs=POLICY_VERSIONS.extra_configs,
        ),
        TopicSpec(config.ticks_topic, partitions, retention_ms=60 * 60 * 1000),
    ]
    missing = [spec for spec in renamed if spec.name not in present]
    ensure_topics(kafka, missing, replication_factor=config.replication_factor)
    return partitions


def build_app(shared: SharedConfig, config: StreamsConfig) -> faust.App:
    """The Faust app of one stream worker, with its agent, timers and services wired.

    Creating it declares missing topics and opens Kafka clients; nothing happens at
    import. ``run_worker`` starts it.
    """
    # --- configuration ----------------------------------------------------------------------

    SHARED, CONFIG, WEIGHTS = shared, config, shared.weights
    RUN_ID = SHARED.run_id
    KAFKA = SHARED.kafka.client_config()
    TOPICS = CONFIG.topics

    INSTANCE = default_instance()  # its heartbeat key and Kafka client id
    RAW_PARTITIONS = prepare_topics(KAFKA, CONFIG)
    torch.set_num_threads(CONFIG.old_logits.torch_threads)

    # --- the app ------------------------------------------------------------------------------

    app = faust.App(
        CONFIG.app_id,
        broker=broker_urls(SHARED.kafka),
        broker_credentials=broker_credentials(SHARED.kafka),
        # Its consumer-group member shows this id, so lag per worker (`rollstream up`'s
        # display) is told by instance.
        broker_client_id=f"{CONFIG.app_id}-{INSTANCE}",
        store="memory://",
        processing_guarantee=CONFIG.processing_guarantee,
        broker_commit_interval=CONFIG.commit_interval_s,
        broker_session_timeout=CONFIG.session_timeout_s,
        topic_replication_factor=CONFIG.replication_factor,
        topic_partitions=RAW_PARTITIONS,
        table_standby_replicas=0,
        producer_max_request_size=16 * 1024 * 1024,
        web_enabled=False,
    )

    # --- topics and table ---------------------------------------------------------------------

    source = app.topic(TOPICS.raw, CONFIG.ticks_topic, key_serializer="raw", value_serializer="raw")
    groups = app.Table(
        "groups",
        partitions=RAW_PARTITIONS,
        key_type=bytes,  # raw bytes in and out of the changelog (streams.groups)
        value_type=bytes,
        help="Group assembly state, samples and source watermarks (streams.groups).",
    )

    # --- services -----------------------------------------------------------------------------

    metrics = StreamMetrics()
    tracker = VersionTracker()
    policy = StalenessPolicy(CONFIG.staleness)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="old-logits")

    def _snapshot_source():
        old = CONFIG.old_logits
        if old.mode == "off":
            return None
        if old.source == "seeded":
            return SeededSource(old.model, old.seed_base)
        from weights.follower import WeightFollower
        from weights.store import WeightStore

        store = WeightStore.from_config(SHARED.s3, RUN_ID, SHARED.policy)
        return FollowerSource(
            store,
            make_follower=lambda s: WeightFollower.from_config(s, WEIGHTS),
            timeout_s=old.rebuild_timeout_s,
        )

    snapshot_source = _snapshot_source()
    snapshots = SnapshotStore(
        snapshot_source,
        budget_bytes=int(CONFIG.old_logits.snapshot_memory_mb * 1024 * 1024),
        dtype=getattr(torch, CONFIG.old_logits.dtype),
        metrics=metrics,
    )
    engine = OldLogitEngine(
        CONFIG.old_logits, snapshots, metrics=metrics, cache_dir=SHARED.cache_dir
    )
    vocab_size = context = None
    if CONFIG.old_logits.mode == "exact":  # records must fit the model they are run through
        vocab_size, context = model_limits(CONFIG.old_logits.model, SHARED.cache_dir)
    processor = Processor(
        CONFIG,
        RUN_ID,
        tracker,
        groups.data,
        metrics,
        model_vocab_size=vocab_size,
        model_context=context,
        served_policy=SHARED.policy,
    )
    writer = EffectWriter(app, groups, exactly_once=CONFIG.processing_guarantee == "exactly_once")

    def _on_new_version(version: int) -> None:
        metrics.trainer_version.set(version)
        snapshots.retain(policy.oldest_admitted(version))

    versions = VersionReader(
        KAFKA,
        TOPICS.versions,
        RUN_ID,
        tracker,
        on_version=_on_new_version,
        registry=metrics.registry,
    )

    async def _seek_raw(partition: int, offset: int) -> None:
        await app.consumer.seek(TP(TOPICS.raw, partition), offset)

    async def _restore_partition(partition: int) -> None:
        changelog = groups.changelog_topic.get_topic_name()
        writes, _end = await asyncio.to_thread(
            read_changelog_partition, KAFKA, changelog, partition
        )
        mirror_writes(groups, partition, writes)

    gaps = GapGuard(
        groups.data,
        KAFKA,
        TOPICS.raw,
        _seek_raw,
        start_topic=CONFIG.start_topic if CONFIG.first_start == "committed" else None,
        restore=_restore_partition,
    )

    @app.on_partitions_revoked.connect
    async def _revoked(app: faust.App, revoked: set[TP], **_: object) -> None:
        gaps.revoked(tp.partition for tp in revoked if tp.topic == TOPICS.raw)

    # --- the agent ----------------------------------------------------------------------------

    @app.agent(source)
    async def assemble(stream: faust.StreamT) -> None:
        """One message at a time: decide, compute old logits off-loop, apply atomically."""
        await _versions_caught_up()
        async for event in stream.events():
            message = event.message
            msg = Message(
                message.topic,
                message.partition,
                message.offset,
                event.key,
                event.value,
                tuple(_headers(message.headers)),
            )
            with gaps.busy():
                if not await gaps.admit(msg):
                    continue  # records before it were skipped upstream; they are being re-read
                try:
                    step = await _step(msg)
                except Exception as err:  # a bug must not kill the worker: dead-letter it
                    log.exception(
                        "processing %s-%d@%d failed", msg.topic, msg.partition, msg.offset
                    )
                    step = processor.failed(msg, err)
                await writer.apply(step, commit=gaps.rereading(msg))

    async def _versions_caught_up(warn_every_s: float = 60.0) -> None:
        """Judge no record before the trainer's version is known (see streams.versions):
        wait, however long the version topic stays unreadable, and say so now and then.
        Going on without it would judge staleness against no version at all."""
        versions.start()
        waited_since = last_warning = time.monotonic()
        while not versions.caught_up.is_set():
            if time.monotonic() - last_warning > warn_every_s:
                last_warning = time.monotonic()
                log.warning(
                    "%s not read to its end after %.0fs; no record is judged until it is",
                    TOPICS.versions,
                    last_warning - waited_since,
                )
            await asyncio.sleep(0.05)

    async def _step(msg: Message) -> Step:
        """A group whose old logits fail is failed alone (every sample dead-lettered by
        ``Processor.finish``); the other groups closed by the same message go on."""
        now = _now_ms()
        step = processor.handle(msg, now)
        attached, failed = {}, {}
        loop = asyncio.get_running_loop()
        for closing in step.closings:
            if closing.emit:
                group_id = closing.state.group_id
                try:
                    attached[group_id] = await loop.run_in_executor(
                        executor, engine.attach, closing.samples
                    )
                except Exception as err:
                    log.exception("old logits of group %s failed", group_id)
                    failed[group_id] = f"old logits: {type(err).__name__}: {err}"
        return processor.finish(step, attached, _now_ms(), failed)

    # --- timer: ticks for overdue groups ----------------------------------------------------

    _ticks = Producer({**KAFKA, "linger.ms": 0})

    @app.timer(interval=CONFIG.groups.tick_interval_s)
    async def tick() -> None:
        """Send a tick to each of our partitions that holds an overdue group or marker."""
        mine = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == TOPICS.raw}
        for partition in processor.due_partitions(_now_ms()) & mine:
            _ticks.produce(CONFIG.ticks_topic, value=b"", partition=partition)
        _ticks.poll(0)

    @app.timer(interval=GAP_SWEEP_INTERVAL_S)
    async def sweep_gaps() -> None:
        """Seek back partitions whose consumer moved past records the agent never got: a
        hole at a partition's end, which no later record reveals (see ``streams.gaps``)."""
        if app.rebalancing or app.in_recovery:
            return

        async def position(partition: int) -> int | None:
            return await app.consumer.position(TP(TOPICS.raw, partition))

        mine = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == TOPICS.raw}
        try:
            await gaps.sweep(sorted(mine), position)
        except Exception:  # revoked mid-sweep, broker gone: the next sweep tries again
            log.warning("gap sweep failed", exc_info=True)

    # --- startup: version tracking, weight following, metrics ---------------------------------

    def _presence_detail() -> dict[str, object]:
        actives = app.assignor.assigned_actives()
        return {"raw_partitions": sorted(tp.partition for tp in actives if tp.topic == TOPICS.raw)}

    beacon: list[Beacon] = []  # started with the services, told to leave on shutdown

    @app.timer(interval=SHARED.presence.interval_s)
    async def report_lag() -> None:
        """This worker's partitions and lag, as its consumer group says (metrics)."""
        try:
            members = await asyncio.to_thread(group_lag, KAFKA, CONFIG.app_id, TOPICS.raw)
        except Exception:  # mid-rebalance or a slow broker: the next tick tries again
            log.debug("lag: group not described", exc_info=True)
            return
        mine = member_of(members, f"{CONFIG.app_id}-{INSTANCE}")
        metrics.raw_partitions.set(len(mine.partitions) if mine is not None else 0)
        metrics.raw_lag.set(mine.lag if mine is not None else 0)

    @app.on_before_shutdown.connect
    async def _leave(app: faust.App, **_: object) -> None:
        for b in beacon:
            await asyncio.to_thread(b.leave)

    @app.task
    async def start_services() -> None:
        check_faust_internals(app.producer)
        versions.start()
        if SHARED.presence.enabled:
            beacon.append(
                Beacon(
                    KAFKA,
                    SHARED.presence.topic,
                    run=RUN_ID,
                    role="streams",
                    instance=INSTANCE,
                    interval_s=SHARED.presence.interval_s,
                    detail=_presence_detail,
                ).start()
            )
        if snapshot_source is not None and CONFIG.old_logits.source == "s3":
            _start_follower()
        if CONFIG.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(CONFIG.metrics_port, registry=metrics.registry)
        log.info(
            "streams: run %s, raw %s (%d partitions), old logits %s, guarantee %s",
            RUN_ID,
            TOPICS.raw,
            RAW_PARTITIONS,
            CONFIG.old_logits.mode,
            CONFIG.processing_guarantee,
        )

    def _start_follower() -> None:
        from weights.follower import FollowerMetrics, WeightFollower
        from weights.store import WeightStore

        store = WeightStore.from_config(SHARED.s3, RUN_ID, SHARED.policy)
        follower = WeightFollower.from_config(
            store,
            WEIGHTS,
            on_version=snapshots.on_snapshot,
            metrics=FollowerMetrics(metrics.registry),
        )
        listener = AnnouncementListener(KAFKA, RUN_ID, TOPICS.versions)
        FollowerFeed(follower, listener, WEIGHTS.poll_interval_s).start()

    return app


def _headers(headers: object) -> list[tuple[str, bytes]]:
    if headers is None:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(k), bytes(v) if v is not None else b"") for k, v in pairs]  # type: ignore[union-attr]


def _now_ms() -> int:
    return int(time.time() * 1000)


def run_worker(app: faust.App, datadir: Path, loglevel: str = "info") -> NoReturn:
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
    sys.argv = [sys.argv[0], f"--datadir={datadir}", "worker", "--without-web", "-l", loglevel]
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
