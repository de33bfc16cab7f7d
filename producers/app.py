"""The producer process: ``run_producer`` opens what a rollout worker needs, runs it, and
closes it all.

Each resource is registered on one ``AsyncExitStack`` right where it is opened, so it is
closed in reverse order of opening whatever fails: the heartbeat leaves first (saying how
the producer stopped), then the weight follower stops (the peers' followers with it: one
stop event) and is joined before its announcements are closed, then the peers' side
(heartbeats, followers, publishers, ledgers, engines), the curriculum's reader, the
publisher (its last acknowledgements still reach the ledger), the ledger, and the engine
last. The ledger's ``stopped`` line is written before any of it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from core.config import RoleConfig, SharedConfig
from producers.config import ProducersConfig, RolloutConfig
from producers.engine.backends import Backend, http_backend, local_backend
from producers.gateway.desk import EpisodeDesk
from producers.gateway.server import Gateway, ServedPolicy
from producers.rollout.admission import TrainerSignals
from producers.rollout.curriculum import Curriculum, PromptStatsReader, PromptStatsView
from producers.rollout.group_publisher import recovered_publisher
from producers.rollout.ledger import Ledger, StopRecord, ledger_dir
from producers.rollout.metrics import ProducerMetrics, Progress
from producers.rollout.peers import PeerSide
from producers.rollout.publishing import Outbox, ProducerIdentity
from producers.rollout.versions import WatchedListener, start_follower
from producers.rollout.worker import RolloutWorker, WorkerLinks, WorkerReport
from producers.tasks.environments import EpisodeLimits

logger = logging.getLogger(__name__)


def default_producer_id() -> str:
    return socket.gethostname()


async def run_producer(
    config: SharedConfig,
    producers: ProducersConfig,
    *,
    groups: int | None = None,
    install_signals: bool = True,
    consumed_version: Callable[[], int | None] | None = None,
    on_worker: Callable[[RolloutWorker], Any] | None = None,
    peer_configs: Mapping[str, RoleConfig[ProducersConfig]] | None = None,
) -> WorkerReport:
    """Run a rollout worker for a resolved ``RollstreamConfig`` (Kafka address known).

    Opens (and recovers) the ledger, connects the engine (``rollout.engine_url``, else an
    in-process engine), builds the task, starts a ``WeightFollower`` thread on the run's
    weight store (``rollout.follow_weights``: verified versions go to ``submit_version``;
    the announcements it reads tell the worker how far behind it is), and publishes until
    ``groups`` groups are delivered (default ``rollout.groups``) or a signal arrives.
    ``consumed_version`` is the trainer's consumed version for admission control (none by
    default); ``on_worker`` receives the worker before it runs (tests, extra wiring).
    ``peer_configs``: the resolved views of the peer policies ``rollout.peers`` names
    (a multi-policy run); each gets an engine, a follower, a ledger and a publisher here.
    With ``rollout.gateway.enabled`` the groups are played by agents through the
    OpenAI-compatible gateway (``producers.gateway``), served while the worker runs.
    """
    from core.presence import Beacon
    from core.topic_reader import end_offsets
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task

    rollout = producers.rollout
    producer_id = rollout.producer_id or default_producer_id()
    client_config = config.kafka.client_config()
    end_offsets(client_config, rollout.topic)  # fails early and clearly if the topic is missing
    metrics = ProducerMetrics()
    if rollout.metrics_port is not None:
        metrics.serve(rollout.metrics_port, rollout.metrics_host)
    missing = sorted(set(rollout.peers) - set(peer_configs or {}))
    if missing:
        raise ValueError(f"producers.rollout.peers names policies without a config: {missing}")
    directory = ledger_dir(config.state_dir, config.run_id, producer_id, config.policy)
    stop_following = threading.Event()  # the driver's weight follower and its peers'

    async with contextlib.AsyncExitStack() as stack:
        backend: Backend
        tokenizer = None
        vocab_size: int | None = None  # an engine's vocabulary, to check observations against
        if rollout.engine_url:
            remote = await http_backend(
                rollout, producers.engine, directory / "weights", config.cache_dir, config.lora
            )
            tokenizer, backend = remote.tokenizer, remote
        else:
            local = await local_backend(producers.engine, config.cache_dir, rollout.initial_version)
            tokenizer, vocab_size = local.engine.tokenizer, local.engine.vocab_size
            backend = local
        stack.push_async_callback(backend.aclose)

        ledger = stack.enter_context(Ledger(directory, fsync=rollout.ledger_fsync))
        publisher = await recovered_publisher(client_config, rollout, ledger, metrics)
        ledger.close_interrupted()  # gateway episodes a kill left open
        stack.push_async_callback(asyncio.to_thread, publisher.close)

        curriculum = None
        if rollout.curriculum.enabled:
            view = PromptStatsView(config.run_id)
            stats_reader = PromptStatsReader(client_config, rollout.curriculum.topic, view).start()
            stack.callback(stats_reader.close)
            curriculum = Curriculum(
                rollout.curriculum,
                view,
                on_skip=lambda reason: metrics.curriculum_skipped.labels(reason=reason).inc(),
            )

        peer_side = await stack.enter_async_context(
            PeerSide(config, producer_id, metrics, stop=stop_following)
        )
        for name in rollout.peers:
            await peer_side.add(name, (peer_configs or {})[name])
        task = make_task(
            rollout.task,
            rollout.task_options,
            TaskContext(
                config.cache_dir,
                tokenizer,
                peers=peer_side.peers,
                agents_score=rollout.gateway.enabled,
            ),
        )
        resume = getattr(task, "resume", None)
        if resume is not None:  # a task walking its dataset goes on where the ledger says
            resume(ledger.state.delivered_positions)
        watcher: WatchedListener | None = None  # the follower's, once it runs
        desk = gateway_desk(rollout, metrics, ledger)
        worker = RolloutWorker(
            rollout,
            backend,
            task,
            Outbox(
                publisher,
                peer_side.publishers,
                mark=lambda: end_offsets(client_config, rollout.topic),
            ),
            ProducerIdentity(config.run_id, producer_id, config.s3.name, config.policy),
            links=WorkerLinks(
                trainer=TrainerSignals(
                    announcement=lambda: watcher.latest if watcher is not None else None,
                    announced_version=lambda: watcher.newest if watcher is not None else None,
                    consumed_version=consumed_version,
                    wait_for_first_version=rollout.follow_weights,
                ),
                peers=peer_side.peers,
                curriculum=curriculum,
                gateway=desk,
            ),
            vocab_size=vocab_size,
        )
        if desk is not None:
            served = ServedPolicy(
                model_name=rollout.expected_model or producers.engine.model,
                tokenizer=tokenizer,
                group_size=rollout.group_size,
                vocab_size=vocab_size,
            )
            gateway = Gateway(
                rollout.gateway,
                desk,
                worker.generator,
                metrics,
                served,
                settled=lambda group_id: settled(ledger, group_id),
            )
            await gateway.start()
            stack.push_async_callback(gateway.close)
        if rollout.follow_weights:
            follower = start_follower(config, worker, stop_following)
            stack.callback(follower.listener.close)  # once the thread is joined
            stack.push_async_callback(follower.join)
            stack.callback(stop_following.set)
            watcher = follower.listener
        peer_side.start_following(asyncio.get_running_loop())
        if on_worker is not None:
            on_worker(worker)
        if config.presence.enabled:
            beacon = Beacon(
                client_config,
                config.presence.topic,
                run=config.run_id,
                role="producer",
                instance=producer_id,
                interval_s=config.presence.interval_s,
                detail=_presence_detail(worker, rollout.engine_url),
            ).start()
            stack.callback(_leave, beacon, worker, ledger, rollout.engine_url)
            peer_side.announce()

        target = groups if groups is not None else rollout.groups
        progress = Progress(metrics, enabled=rollout.progress, total=target)
        with _stop_on_signals(worker, install_signals):
            report = await worker.run(target, progress=progress)
        if report.stop_requested:
            record = stop_record(report, ledger, rollout.stop_policy)
            ledger.stopped(record)
            peer_side.stopped(record)
            logger.info(
                "stopped (%s): %d group(s) in flight finished, %d aborted, %d unacknowledged",
                record.policy,
                len(record.finished),
                len(record.aborted),
                len(record.unacknowledged),
            )
        return report


def gateway_desk(
    rollout: RolloutConfig, metrics: ProducerMetrics, ledger: Ledger | None = None
) -> EpisodeDesk | None:
    """The desk that hands groups to the gateway's agents, when the gateway is on; it
    commits their calls to ``ledger``."""
    if not rollout.gateway.enabled:
        return None
    limits = dataclasses.replace(EpisodeLimits(), **rollout.episode.overrides())
    return EpisodeDesk(rollout.gateway, limits, metrics, ledger)


def settled(ledger: Ledger, group_id: str) -> str | None:
    """What Kafka acknowledged of a group, by the ledger: ``published`` (the raw topic),
    ``dead_lettered`` (the dead-letter topic), or None (not yet, or never)."""
    if group_id in ledger.state.delivered:
        return "published"
    return "dead_lettered" if group_id in ledger.state.dead_lettered else None


def stop_record(report: WorkerReport, ledger: Ledger, policy: str) -> StopRecord:
    """Which groups in flight at the stop request were published (finished) and which
    were not (aborted), by the ledger: a group counts as published once it has a
    ``pending`` line, acknowledged or not."""
    state = ledger.state
    published = {gid for gid in report.inflight_at_stop if gid in state.delivered}
    published |= {gid for gid in report.inflight_at_stop if gid in state.pending}
    return StopRecord(
        policy=policy,
        finished=sorted(published),
        aborted=sorted(set(report.inflight_at_stop) - published),
        unacknowledged=sorted(state.pending),
    )


def _presence_detail(worker: RolloutWorker, engine_url: str | None) -> Callable[[], dict[str, Any]]:
    """What a producer's heartbeat says about it."""

    def detail() -> dict[str, Any]:
        return {
            "engine": engine_url or "in-process",
            "version": worker.version,
            "groups": worker.publisher.delivered_groups,
            "inflight": len(worker.inflight_groups),
        }

    return detail


def _leave(beacon: Any, worker: RolloutWorker, ledger: Ledger, engine_url: str | None) -> None:
    """The heartbeat's last word: the producer's figures and how it stopped, if it did."""
    stops = ledger.state.stops
    beacon.leave(
        {
            **_presence_detail(worker, engine_url)(),
            **(
                {
                    "stop_policy": stops[-1].policy,
                    "finished": len(stops[-1].finished),
                    "aborted": len(stops[-1].aborted),
                }
                if stops
                else {}
            ),
        }
    )


@contextlib.contextmanager
def _stop_on_signals(worker: RolloutWorker, install: bool) -> Iterator[None]:
    """SIGINT/SIGTERM stop ``worker`` while the block runs (``install``)."""
    import signal

    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if install else ()
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, worker, sig)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _on_signal(worker: RolloutWorker, sig: int) -> None:
    import os
    import signal

    if worker.stopping:  # a second signal: leave now
        logger.warning("second signal: exiting without waiting for acknowledgements")
        os._exit(128 + sig)
    logger.info("%s received: finishing", signal.Signals(sig).name)
    worker.request_stop()
