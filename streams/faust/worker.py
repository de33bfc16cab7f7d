"""``StreamWorker``: one stream worker's Faust app and the services its agent uses.

Constructing it declares missing topics (``streams.faust.topics``), creates the app, its source
topic and table, the services, and registers the agent, the timers and the start-up task
on the app, in that order. Faust fixes at build time what a worker is: its table (the
worker's memory of the group table, ``streams.faust.topics.MEMORY_TABLE_NAME``), the group
table's changelog the steps write (``<app_id>-groups-changelog``, what each partition is
rebuilt from), and the order timers and tasks start in;
``tests/integration/streams/test_worker.py`` pins them. Each part is a method or a small
collaborator: ``OldLogitPass`` (where old logits come from), ``streams.faust.agent.Assembler``
(the agent's work per message), and the worker's own timers (ticks, gap sweeps, lag) and start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faust
import torch
from confluent_kafka import Producer
from faust.types import TP, StreamT, TableT

from core.config import SharedConfig
from core.presence import Beacon, default_instance
from core.topic_reader import group_lag, member_of
from infra.topics import replication
from schemas.control import VersionAnnouncement
from schemas.topics import TopicSpec, largest_message, producer_limits
from streams.config import OldLogitsConfig, StreamsConfig
from streams.faust.agent import Assembler, message_of, now_ms, wait_for_versions
from streams.faust.broker import broker_credentials, broker_urls
from streams.faust.gaps import GAP_SWEEP_INTERVAL_S, GapGuard
from streams.faust.restore import read_changelog_partition
from streams.faust.topics import MEMORY_TABLE_NAME, changelog_name, prepare_topics
from streams.faust.txn import EffectWriter, Failpoint, check_faust_internals, replace_partition
from streams.metrics import StreamMetrics
from streams.oldlogits import model_limits, old_logit_engine_for
from streams.processor import Processor
from streams.snapshots import (
    FollowerFeed,
    FollowerSource,
    SeededSource,
    SnapshotSource,
)
from streams.staleness import StalenessPolicy, VersionTracker
from streams.versions import VersionReader, VersionVoucher
from weights.announce import AnnouncementListener

log = logging.getLogger("streams")

AGENT_NAME = "streams.app.assemble"
"""The agent's key in ``app.agents`` and its stream's prefix: the name Faust gave it when
it was a function of ``streams.faust.app``, kept so that nothing named after it changes."""


class OldLogitPass:
    """Where the worker's old logits come from: the snapshot source (seeded weights, or the
    run's weights in S3), the snapshot store under its memory budget, the engine, and the
    follower that pushes each new version into the store."""

    def __init__(
        self, shared: SharedConfig, config: OldLogitsConfig, metrics: StreamMetrics
    ) -> None:
        self.shared = shared
        self.config = config
        self.metrics = metrics
        self.source = self._snapshot_source()
        self.engine = old_logit_engine_for(
            config, self.source, metrics=metrics, cache_dir=shared.cache_dir, lora=shared.lora
        )
        self.device = self.engine.device
        self.snapshots = self.engine.snapshots

    def _snapshot_source(self) -> SnapshotSource | None:
        old = self.config
        if old.mode == "off":
            return None
        if old.source == "seeded":
            if self.shared.lora is not None:
                raise ValueError("a LoRA run's old logits need its adapters: source 'weights'")
            return SeededSource(old.model, old.seed_base)
        from weights.follower import WeightFollower
        from weights.store import WeightStore

        store = WeightStore.from_config(self.shared.s3, self.shared.run_id, self.shared.policy)
        return FollowerSource(
            store,
            make_follower=lambda s: WeightFollower.from_config(s, self.shared.weights),
            timeout_s=old.rebuild_timeout_s,
        )

    def model_limits(self) -> tuple[int | None, int | None]:
        """The vocabulary size and context of the model records are run through (exact
        mode: a record must fit it); ``(None, None)`` when no model runs."""
        if self.config.mode != "exact":
            return None, None
        return model_limits(self.config.model, self.shared.cache_dir)

    @property
    def follows_weights(self) -> bool:
        """Whether the store is fed by a follower of the run's weights (source ``s3``)."""
        return self.source is not None and self.config.source == "s3"

    def start_follower(self, kafka: dict[str, str], versions_topic: str) -> None:
        """Follow the run's weights: each version the trainer announces on
        ``versions_topic`` is loaded and pushed into the snapshot store."""
        from weights.follower import FollowerMetrics, WeightFollower
        from weights.store import WeightStore

        shared = self.shared
        store = WeightStore.from_config(shared.s3, shared.run_id, shared.policy)
        follower = WeightFollower.from_config(
            store,
            shared.weights,
            on_version=self.snapshots.on_snapshot,
            metrics=FollowerMetrics(self.metrics.registry),
        )
        listener = AnnouncementListener(
            kafka, shared.run_id, versions_topic, confirm=announcement_check(shared)
        )
        FollowerFeed(follower, listener, shared.weights.poll_interval_s).start()


def announcement_check(shared: SharedConfig) -> Callable[[VersionAnnouncement], bool | None] | None:
    """Announcements move the stream's clock only once the weight store holds a signed
    manifest for them (``weights.trust``); None where unsigned weights are allowed."""
    from weights.store import WeightStore
    from weights.trust import Trust

    trust = Trust.from_config(shared.weights)
    if trust.public_key is None:
        return None
    return trust.announcement_check(
        WeightStore.from_config(shared.s3, shared.run_id, shared.policy)
    )


def store_voucher(shared: SharedConfig) -> VersionVoucher:
    """The weight store's word on versions the announcements have not brought yet."""
    from weights.store import WeightStore
    from weights.trust import Trust

    return VersionVoucher(
        lambda: WeightStore.from_config(shared.s3, shared.run_id, shared.policy),
        Trust.from_config(shared.weights),
    )


class StreamWorker:
    """One stream worker: builds and wires its Faust app (``self.app``) on construction.

    Nothing happens at import; ``streams.faust.app.run_worker`` runs the app."""

    def __init__(self, shared: SharedConfig, config: StreamsConfig, datadir: Path) -> None:
        self.shared = shared
        self.config = config
        self.datadir = datadir
        self.run_id = shared.run_id
        self.kafka = shared.kafka.client_config()
        self.topics = config.topics
        self.instance = default_instance()  # its heartbeat key and Kafka client id
        self.topic_specs = prepare_topics(self.kafka, config, shared.kafka)
        self.raw_partitions = self.topic_specs[0].partitions
        torch.set_num_threads(config.old_logits.torch_threads)

        self.app = self._make_app()
        self.source = self.app.topic(
            self.topics.raw, config.ticks_topic, key_serializer="raw", value_serializer="raw"
        )
        self.groups = self._make_table()

        self.metrics = StreamMetrics()
        self.tracker = VersionTracker()
        self.policy = StalenessPolicy(config.staleness)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="old-logits")
        self.old_logits = OldLogitPass(shared, config.old_logits, self.metrics)
        self.processor = self._make_processor()
        self.writer = EffectWriter(
            self.app,
            self.groups,
            changelog_name(config),
            exactly_once=config.processing_guarantee == "exactly_once",
            failpoint=Failpoint.from_env(),
        )
        self.versions = VersionReader(
            self.kafka,
            self.topics.versions,
            self.run_id,
            self.tracker,
            on_version=self._on_new_version,
            registry=self.metrics.registry,
            confirm=announcement_check(shared),
        )
        self.gaps = self._make_gap_guard()
        self.assembler = Assembler(
            self.processor,
            self.old_logits.engine,
            self.gaps,
            self.writer,
            executor,
            voucher=store_voucher(shared),
        )
        ticks = next(s for s in self.topic_specs if s.name == config.ticks_topic)
        self._ticks = Producer({**self.kafka, **producer_limits(ticks), "linger.ms": 0})
        self._beacons: list[Beacon] = []  # started with the services, told to leave on shutdown
        self._register()

    # --- the app, its table and services ----------------------------------------------------

    @property
    def client_id(self) -> str:
        """This worker's Kafka client id: its consumer-group member shows it, so lag per
        worker (``rollstream up``'s display) is told by instance."""
        return f"{self.config.app_id}-{self.instance}"

    def _make_app(self) -> faust.App:
        config = self.config
        return faust.App(
            config.app_id,
            # Faust makes its table directory when the app is built, in ./<app_id>-data
            # unless told: a worker writes nothing in the directory it was started from
            datadir=str(self.datadir),
            broker=broker_urls(self.shared.kafka),
            broker_credentials=broker_credentials(self.shared.kafka),
            broker_client_id=self.client_id,
            store="memory://",
            processing_guarantee=config.processing_guarantee,
            broker_commit_interval=config.commit_interval_s,
            broker_session_timeout=config.session_timeout_s,
            # the factor every topic gets: prepare_topics made them all, Faust's included
            topic_replication_factor=replication(self.kafka, self.shared.kafka).factor,
            topic_partitions=self.raw_partitions,
            table_standby_replicas=0,
            # it writes every topic of the worker but raw: the largest record any takes
            producer_max_request_size=largest_message(*self.topic_specs),
            web_enabled=False,
        )

    @property
    def changelog(self) -> TopicSpec:
        """The group table's changelog, as ``streams.faust.topics`` declares it."""
        name = changelog_name(self.config)
        return next(spec for spec in self.topic_specs if spec.name == name)

    def _make_table(self) -> TableT:
        return self.app.Table(
            MEMORY_TABLE_NAME,
            partitions=self.raw_partitions,
            key_type=bytes,  # raw bytes in and out of the changelog (streams.groups)
            value_type=bytes,
            # what Faust declares, should it create the changelog (streams.faust.topics did)
            extra_topic_configs={"max.message.bytes": str(self.changelog.max_message_bytes)},
            help="Group assembly state, samples and source watermarks (streams.groups).",
        )

    def _make_processor(self) -> Processor:
        vocab_size, context = self.old_logits.model_limits()
        return Processor(
            self.config,
            self.run_id,
            self.tracker,
            self.groups.data,
            self.metrics,
            model_vocab_size=vocab_size,
            model_context=context,
            served_policy=self.shared.policy,
        )

    def _make_gap_guard(self) -> GapGuard:
        """The gap guard, with where a partition without a watermark starts: the offset
        recorded on the start topic when ``first_start = "committed"`` (``streams.faust.start``),
        else raw's beginning."""
        config = self.config
        return GapGuard(
            self.groups.data,
            self.kafka,
            self.topics.raw,
            self._seek_raw,
            start_topic=config.start_topic if config.first_start == "committed" else None,
            restore=self._restore_partition,
        )

    def _on_new_version(self, version: int) -> None:
        """The trainer moved on: show it, and let snapshots no record can use any more go."""
        self.metrics.trainer_version.set(version)
        self.old_logits.snapshots.retain(self.policy.oldest_admitted(version))

    async def _seek_raw(self, partition: int, offset: int) -> None:
        await self.app.consumer.seek(TP(self.topics.raw, partition), offset)

    async def _restore_partition(self, partition: int) -> None:
        changelog = changelog_name(self.config)
        writes, _end = await asyncio.to_thread(
            read_changelog_partition, self.kafka, changelog, partition
        )
        dropped = replace_partition(self.groups, partition, writes)
        if dropped:
            log.warning(
                "%s-%d: %d key(s) in the table were written by no committed step; dropped",
                changelog,
                partition,
                dropped,
            )

    def _my_raw_partitions(self) -> set[int]:
        """The raw partitions assigned to this worker as active (not standby)."""
        actives = self.app.assignor.assigned_actives()
        return {tp.partition for tp in actives if tp.topic == self.topics.raw}

    # --- what is registered on the app, in this order ---------------------------------------

    def _register(self) -> None:
        app = self.app
        app.on_partitions_revoked.connect(self._on_revoked)
        app.agent(self.source, name=AGENT_NAME)(self.assemble)
        app.timer(interval=self.config.groups.tick_interval_s)(self.tick)
        app.timer(interval=GAP_SWEEP_INTERVAL_S)(self.sweep_gaps)
        app.timer(interval=self.shared.presence.interval_s)(self.report_lag)
        app.on_before_shutdown.connect(self._leave)
        app.task(self.start_services)

    async def _on_revoked(self, app: faust.App, revoked: set[TP], **_: object) -> None:
        await self.writer.abort_open_transactions()
        self.gaps.revoked(tp.partition for tp in revoked if tp.topic == self.topics.raw)

    async def assemble(self, stream: StreamT) -> None:
        """One message at a time: decide, compute old logits off-loop, apply atomically."""
        await wait_for_versions(self.versions)
        async for event in stream.events():
            await self.assembler.handle(message_of(event))

    async def tick(self) -> None:
        """Send a tick to each of our partitions that holds an overdue group or marker
        (each rebuilt from the changelog first: a partition no record comes to may still
        hold groups waiting for their timeout)."""
        if self.app.rebalancing:
            return
        mine = self._my_raw_partitions()
        try:
            for partition in sorted(mine):
                await self.gaps.ensure_restored(partition)
        except Exception:  # revoked mid-rebuild, broker gone: the next tick tries again
            log.warning("rebuilding the table before a tick failed", exc_info=True)
            return
        for partition in self.processor.due_partitions(now_ms()) & mine:
            self._ticks.produce(self.config.ticks_topic, value=b"", partition=partition)
        self._ticks.poll(0)

    async def sweep_gaps(self) -> None:
        """Seek back partitions whose consumer moved past records the agent never got: a
        hole at a partition's end, which no later record reveals (see ``streams.faust.gaps``)."""
        app = self.app
        if app.rebalancing or app.in_recovery:
            return

        async def position(partition: int) -> int | None:
            return await app.consumer.position(TP(self.topics.raw, partition))

        mine = self._my_raw_partitions()
        try:
            await self.gaps.sweep(sorted(mine), position)
        except Exception:  # revoked mid-sweep, broker gone: the next sweep tries again
            log.warning("gap sweep failed", exc_info=True)

    async def report_lag(self) -> None:
        """This worker's partitions and lag, as its consumer group says (metrics)."""
        try:
            members = await asyncio.to_thread(
                group_lag, self.kafka, self.config.app_id, self.topics.raw
            )
        except Exception:  # mid-rebalance or a slow broker: the next tick tries again
            log.debug("lag: group not described", exc_info=True)
            return
        mine = member_of(members, self.client_id)
        self.metrics.raw_partitions.set(len(mine.partitions) if mine is not None else 0)
        self.metrics.raw_lag.set(mine.lag if mine is not None else 0)

    async def _leave(self, app: faust.App, **_: object) -> None:
        for beacon in self._beacons:
            await asyncio.to_thread(beacon.leave)

    async def start_services(self) -> None:
        """Once the app runs: version reading, the heartbeat, weight following, metrics."""
        check_faust_internals(self.app.producer, self.groups.data)
        self.versions.start()
        presence = self.shared.presence
        if presence.enabled:
            beacon = Beacon(
                self.kafka,
                presence.topic,
                run=self.run_id,
                role="streams",
                instance=self.instance,
                interval_s=presence.interval_s,
                detail=self._presence_detail,
            )
            self._beacons.append(beacon.start())
        if self.old_logits.follows_weights:
            self.old_logits.start_follower(self.kafka, self.topics.versions)
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        log.info(
            "streams: run %s, raw %s (%d partitions), old logits %s, guarantee %s",
            self.run_id,
            self.topics.raw,
            self.raw_partitions,
            self.config.old_logits.mode,
            self.config.processing_guarantee,
        )

    def _presence_detail(self) -> dict[str, object]:
        """What the heartbeat says about this worker: its raw partitions."""
        return {"raw_partitions": sorted(self._my_raw_partitions())}
