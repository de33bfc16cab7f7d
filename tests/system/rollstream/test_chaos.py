"""Chaos: kill -9 every role in turn and two brokers during one run, then reconcile.

One run of the whole pipeline (tiny model, ``copy-first-digit-twice``), with its own
embedded Kafka cluster of three brokers (replication factor 3, ``min.insync.replicas`` 2,
the internal topics too) and SeaweedFS store in the test's temporary directory (brokers
must be killed, so the session's shared one cannot be used). The roles are the commands
``rollstream up`` starts (``rollstream.up.plan.role_specs``), forked from a prefork server
and supervised with ``core.process`` as ``up`` does, under ``up``'s own supervision loop
with ``--restarts 2`` (``rollstream.up.supervise.supervise``). While data flows, an
attacker who can write the bucket and produce to ``policy.versions`` (but holds no signing
key) forges 16 manifests above the trainer's newest version (the next slots the trainer
will claim among them), a replay of the newest announcement with a larger pace and an
announcement of a far version; retention runs every 2 versions with a window of 4. Then
SIGKILL the producer, the engine, the stream worker and the trainer (between two of its
checkpoints), each started again by the supervision loop; then, one at a time, SIGKILL the
broker that leads most of the scored topic's partitions and the one that coordinates the
stream's transactions (found from the cluster's metadata and ``__transaction_state``),
wait for a trainer step on the two left, and start it again on its data directory until
every replica is back in sync. Then drain: stop the producer (SIGTERM), start it once more
to deliver ``GROUPS`` groups and stop by itself (``--groups``), wait until the stream has
an outcome for every raw record and the trainer has trained everything scored, and stop
the trainer (it checkpoints).

The reconciliation (``rollstream.runs.audit``) must hold on the real sets: every trajectory id
the producer ledger says was delivered is trained (trainer ledger), stale
(``rollouts.stale``) or dead-lettered (``rollouts.dlq``); nothing is trained twice; nothing
is trained that the producer ledger does not know; no scored, stale or filtered trajectory
is there twice, and ``prompts.stats`` counts each emitted sample once. Partial groups from
the producer kill (orphaned records) are trained as partial groups or dead-lettered as
incomplete: the documented policy (``streams.processor``), accounted for but not counted
as delivered.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from support.streams import read_topic
from support.weight_states import forge, forged_announcement

from core.process import Launcher, RoleProcess
from infra.kafka import EmbeddedKafkaCluster
from infra.services import Services
from rollstream.config.settings import RollstreamConfig, UpConfig, load_config
from rollstream.runs.audit import AuditReport, audit
from rollstream.runs.reads import AuditSources
from rollstream.up.display import Dashboard, TrainerLog
from rollstream.up.plan import (
    Ports,
    build_config,
    plan_policies,
    role_forker,
    role_specs,
    write_config,
)
from rollstream.up.supervise import STOP_ORDER, StopFlag, supervise
from schemas.codec import decode
from schemas.control import PromptStats, prompt_key
from schemas.group import decode_group
from weights.announce import AnnouncementListener, Announcer
from weights.errors import FormatError, ObjectMissing
from weights.follower import WeightFollower
from weights.store import WeightStore
from weights.trust import Trust

pytestmark = pytest.mark.system

RUN = "chaos"
GROUPS = 8  # the last producer incarnation delivers this many groups, then stops by itself
GROUPS_PER_STEP = 4
CHECKPOINT_EVERY = 3
READY_S = 180.0
RESTARTS = 2  # ``up --restarts 2``
FORGED = 16  # forged manifests above the trainer's newest version
KEEP_VERSIONS = 4
BROKERS = 3  # replication factor 3, min.insync.replicas 2: one broker down at a time
TXN_PARTITIONS = 8  # transaction.state.log.num.partitions of the embedded brokers


def _config(tmp_path: Path) -> tuple[RollstreamConfig, Ports]:
    """The ``up`` config of the run, with what the audit needs on top of it."""
    run_dir = tmp_path / "run"
    base = load_config(
        None,
        run_id=RUN,
        state_dir=str(tmp_path / "state"),
        profile={"groups_per_step": GROUPS_PER_STEP, "staleness_window": 2},
        producers={"rollout": {"mark_interval_s": 5.0, "seed": 7}},
        streams={
            # a killed worker's partitions move on after this; a group closes (partial) this
            # long after its first sample: longer than any outage here, so only a group the
            # producer's kill left incomplete closes partial
            "session_timeout_s": 10.0,
            "groups": {"timeout_s": 60.0},
            # the default future_allowance: the broker restart delays the trainer's
            # announcements while the producer follows S3, so its records run ahead of the
            # stream's clock; the stream asks the weight store about their versions
        },
        trainer={
            "ledger_file": str(run_dir / "trainer-ledger.jsonl"),
            "checkpoint": {"every": CHECKPOINT_EVERY, "dir": str(run_dir / "checkpoints")},
            "publish": {"gc_every": 2},
        },
        weights={"keep_versions": KEEP_VERSIONS},
        kafka={"brokers": BROKERS},
    )
    up = UpConfig(max_steps=100_000)
    ports = Ports.free()
    return build_config(base, up, RUN, run_dir, ports), ports


def _wait(
    what: str,
    done: Callable[[], bool],
    timeout_s: float,
    roles: list[RoleProcess],
    describe: Callable[[], str] = str,
) -> None:
    """Poll ``done``; fail at once, with its log tail, if one of ``roles`` exits meanwhile;
    on a timeout, say what ``describe`` says about the state."""
    deadline = time.monotonic() + timeout_s
    while not done():
        for role in roles:
            if not role.running():
                pytest.fail(
                    f"{role.name} exited ({role.returncode()}) while waiting for {what}:\n"
                    f"{_tail(role)}"
                )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{describe()}")
        time.sleep(0.5)


def _tail(role: RoleProcess, chars: int = 4000) -> str:
    return role.log_file.read_text(errors="replace")[-chars:] if role.log_file.exists() else ""


class Run:
    """The roles of one run and the progress signals the test waits on."""

    def __init__(self, config: RollstreamConfig, ports: Ports, run_dir: Path) -> None:
        path = run_dir / "rollstream.toml"
        write_config(config, path)
        self.config = config
        # forked as up forks its roles: a killed role is forked again
        self.launcher = Launcher(run_dir / "logs", role_forker(run_dir / "logs", 300))
        for spec in role_specs(path, config, plan_policies(config, ports)):
            self.launcher.add(spec)
        self.log = TrainerLog(Path(str(config.trainer.metrics_file)))
        self.events: list[str] = []
        self.ports = ports
        self.supervisor: threading.Thread | None = None
        self.supervision = StopFlag()
        self.outcome: list[tuple[str, bool]] = []
        self.released = threading.Event()

    def role(self, name: str) -> RoleProcess:
        return self.launcher.roles[name]

    def started(self) -> list[RoleProcess]:
        """The roles that must keep running: every started one (none while the
        supervision loop restarts them: then the loop itself must keep running)."""
        if self.supervisor is not None:
            if self.outcome:
                pytest.fail(f"up's supervision loop ended the run: {self.outcome[0]}")
            return []
        return [r for r in self.launcher.roles.values() if r.proc is not None]

    def supervise(self) -> None:
        """Run ``up``'s supervision loop (``--restarts 2``) in a thread from now on."""
        logs = {"": TrainerLog(self.log.path)}  # the loop's own reader of the metrics
        display = Dashboard(self.config, plan_policies(self.config, self.ports), logs)

        def loop() -> None:
            self.outcome.append(supervise(self.launcher, display, self.supervision, RESTARTS))
            # A role dies with the *thread* that started it (its parent-death signal is
            # tied to that thread): the roles this loop restarted live until released.
            self.released.wait()

        self.supervisor = threading.Thread(target=loop, name="up-supervise", daemon=True)
        self.supervisor.start()

    def end_supervision(self) -> None:
        """Stop the loop as ``up``'s signal handler would; it must not have ended the run."""
        assert self.supervisor is not None
        self.supervision.signum = signal.SIGTERM
        deadline = time.monotonic() + 30
        while not self.outcome and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.outcome == [("stopped by SIGTERM", False)], self.outcome
        self.supervisor = None

    def steps(self) -> int:
        """Optimiser steps taken so far, re-trained ones after a crash included."""
        self.log.poll()
        return len(self.log.rows)

    def last_step(self) -> int:
        self.log.poll()
        return int(self.log.rows[-1]["step"]) if self.log.rows else 0

    def wait_steps(self, more: int, timeout_s: float = 120.0) -> None:
        target = self.steps() + more

        def done() -> bool:
            return self.steps() >= target

        _wait(f"{more} more trainer steps", done, timeout_s, self.started())

    def crash(self, name: str, ready_s: float = READY_S) -> None:
        """SIGKILL a role, as ``kill -9`` from outside; the supervision loop starts it again."""
        role = self.role(name)
        starts, pid = role.starts, role.pid
        assert pid is not None and role.running(), f"{name} is not running:\n{_tail(role)}"
        os.kill(pid, signal.SIGKILL)
        self.events.append(f"{name} killed (SIGKILL) at trainer step {self.last_step()}")
        _wait(f"up to restart {name}", lambda: role.starts > starts, 30, self.started())
        role.wait_ready(ready_s)
        self.events.append(f"{name} restarted by up's loop (start {role.starts})")

    def forge(self) -> None:
        """What an attacker with the bucket's credentials and produce rights on
        ``policy.versions``, but no signing key, does to the run."""
        store = WeightStore.from_config(self.config.s3, RUN)
        head = store.versions()[-1]
        for version in range(head + 2, head + 2 + FORGED):
            forge(store, version, like=head)
        client = self.config.kafka.client_config()
        topic = self.config.weights.topic
        listener = AnnouncementListener(client, RUN, topic)
        try:
            newest = listener.latest(timeout_s=30)
        finally:
            listener.close()
        assert newest is not None and newest.groups_per_step == GROUPS_PER_STEP
        attacker = Announcer(client, topic)
        try:
            # a replay claiming the most producers the bounds allow: each one's share shrinks
            replayed = dataclasses.replace(newest, producers=GROUPS_PER_STEP * 3, signature=None)
            attacker.announce(replayed)
            attacker.announce(forged_announcement(RUN, head + 10**6))
        finally:
            attacker.close()
        self.events.append(
            f"forged v{head + 2}..v{head + 1 + FORGED} and two announcements at trainer "
            f"step {self.last_step()} (newest genuine v{head})"
        )


def test_kill_every_role_and_restart_broker_then_reconcile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):  # the session's services and overrides are not ours
        if key.startswith("ROLLSTREAM_") or key in ("KAFKA_BOOTSTRAP_SERVERS", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    started = time.monotonic()
    config, ports = _config(tmp_path)
    services = Services(config)
    run: Run | None = None
    try:
        services.up()
        config = services.resolved()
        run = Run(config, ports, tmp_path / "run")
        for name in ("streams", "trainer", "engine"):  # as ``up``: the producer needs the
            run.role(name).start()  # engine's answer to start
        for name in ("streams", "trainer", "engine", "producer"):
            if name == "producer":
                run.role(name).start()
            run.role(name).wait_ready(READY_S)
        run.wait_steps(1, timeout_s=240)
        run.supervise()
        run.forge()
        run.wait_steps(2)  # past the forged slots' start: the trainer claims around them

        run.crash("producer")
        run.wait_steps(1)  # it recovered; the next kill lands in a running pipeline
        run.crash("engine")
        run.wait_steps(1)
        run.crash("streams")
        run.wait_steps(1)
        # between two checkpoints, so that steps are trained again after the restart: right
        # after the step that follows a checkpoint, two more steps away from the next one
        _wait(
            "the step after a checkpoint",
            lambda: run.last_step() % CHECKPOINT_EVERY == 1,
            120,
            run.started(),
        )
        run.crash("trainer")
        run.wait_steps(1)

        assert isinstance(services.kafka, EmbeddedKafkaCluster)
        for what, find in (
            ("the leader of most rollouts.scored partitions", _scored_leader),
            ("the coordinator of the stream's transactions", _transaction_coordinator),
        ):
            broker = find(config)
            node = services.kafka.node(broker)
            assert node.kill()  # a crash, not a controlled shutdown
            run.events.append(
                f"broker {broker}, {what}, killed (SIGKILL) at step {run.last_step()}"
            )
            run.wait_steps(1, timeout_s=180)  # the run goes on on two brokers
            node.start()
            _wait("every replica back in sync", lambda: _all_in_sync(config), 120, run.started())
            run.events.append(f"broker {broker} started, every partition's replicas in sync")

        # drain: the supervision loop ends (as up's does at a signal), a clean stop of the
        # producer (SIGTERM), then a last incarnation that delivers a fixed number of groups
        # and stops by itself; the stream and the trainer catch up
        run.end_supervision()
        assert run.role("producer").stop(60) == 0, _tail(run.role("producer"))
        run.events.append(f"producer stopped (SIGTERM) at trainer step {run.last_step()}")
        spec = run.role("producer").spec
        producer = RoleProcess(
            dataclasses.replace(spec, argv=[*spec.argv, "--groups", str(GROUPS)]),
            run.launcher.log_dir,
        )
        run.launcher.roles["producer"] = producer
        producer.start()
        others = [r for r in run.started() if r is not producer]
        _wait(f"the producer to deliver {GROUPS} groups", lambda: not producer.running(), 300,
              others)  # fmt: skip
        assert producer.returncode() == 0, _tail(producer)
        run.events.append(f"producer delivered {GROUPS} groups at trainer step {run.last_step()}")
        sources = AuditSources.from_config(config)
        last: list[AuditReport] = []

        def streamed() -> bool:
            last[:] = [audit(sources, timeout_s=30)]
            return bool(last[0].raw and last[0].raw.ids) and not last[0].unprocessed

        def stream_state() -> str:
            if not last:
                return ""
            waiting = sorted(last[0].unprocessed)[:8]
            return f"{last[0].counts()}\nunprocessed: {waiting}\n{_tail(run.role('streams'))}"

        _wait("the stream to process every raw record", streamed, 150, others, stream_state)
        idle_since = [time.monotonic(), run.steps()]

        def trainer_idle() -> bool:
            if run.steps() != idle_since[1]:
                idle_since[:] = [time.monotonic(), run.steps()]
            # longer than the batch's max_wait_s: a half-filled step would have closed
            return time.monotonic() - idle_since[0] > config.trainer.batch.max_wait_s + 7

        _wait("the trainer to go idle", trainer_idle, 120, others)
        assert run.role("trainer").stop(60) == 0, _tail(run.role("trainer"))
        run.launcher.stop_all(STOP_ORDER)

        report = audit(sources, timeout_s=30)
        run.log.poll()
        steps = [int(row["step"]) for row in run.log.rows]
        retrained = len(steps) - len(set(steps))  # trained again after the trainer's kill
        run.events.append(f"{len(steps)} steps taken, {retrained} of them again after a crash")
        _print(report, run.events, time.monotonic() - started)
        _check(report)
        _check_prompt_stats(config)
        _check_weights(config, steps)
        assert retrained > 0, "the trainer was not killed between two checkpoints"
    finally:
        if run is not None:
            run.launcher.stop_all(STOP_ORDER, timeout_s=10)
            run.released.set()
            assert not run.launcher.leftovers()
        services.down()


def _scored_leader(config: RollstreamConfig) -> int:
    """The broker that leads most partitions of the scored topic."""
    admin = AdminClient(config.kafka.client_config())
    topic = admin.list_topics(config.trainer.topics.scored, timeout=30).topics
    leaders = Counter(p.leader for p in topic[config.trainer.topics.scored].partitions.values())
    return leaders.most_common(1)[0][0]


def _transaction_coordinator(config: RollstreamConfig) -> int:
    """The broker coordinating the stream's transactions: the leader of the
    ``__transaction_state`` partition holding most of the stream's transaction records
    (found by reading that topic: an id's records are keyed by it)."""
    prefix = config.streams.app_id.encode()
    consumer = Consumer(
        {**config.kafka.client_config(), "group.id": "chaos-probe", "enable.auto.commit": False}
    )
    holders: Counter[int] = Counter()
    try:
        for partition in range(TXN_PARTITIONS):
            tp = TopicPartition("__transaction_state", partition)
            low, high = consumer.get_watermark_offsets(tp, timeout=30)
            if high <= low:
                continue
            consumer.assign([TopicPartition("__transaction_state", partition, low)])
            for msg in consumer.consume(num_messages=high - low, timeout=10):
                if msg.error() is None and prefix in (msg.key() or b""):
                    holders[partition] += 1
    finally:
        consumer.close()
    assert holders, "no transactional id of the stream in __transaction_state"
    partition = holders.most_common(1)[0][0]
    admin = AdminClient(config.kafka.client_config())
    state = admin.list_topics("__transaction_state", timeout=30).topics["__transaction_state"]
    return state.partitions[partition].leader


def _all_in_sync(config: RollstreamConfig) -> bool:
    """Every partition of the cluster has all its replicas in sync."""
    admin = AdminClient(config.kafka.client_config())
    topics = admin.list_topics(timeout=10).topics.values()
    return all(len(p.isrs) == len(p.replicas) for t in topics for p in t.partitions.values())


def _check_weights(config: RollstreamConfig, steps: list[int]) -> None:
    """The trainer published past every forged slot, retention kept the genuine versions
    (the newest and its chain) despite the forged ones above them, and a follower loads
    the newest genuine version."""
    store = WeightStore.from_config(config.s3, RUN)
    trust = Trust.from_config(config.weights)
    newest = trust.latest(store)
    assert newest is not None and newest >= max(steps), (newest, max(steps))
    genuine = [v for v in store.versions() if _verifies(trust, store, v)]
    assert newest in genuine and len(genuine) >= KEEP_VERSIONS, genuine
    snapshot = WeightFollower(store, public_key=trust.public_key).sync(newest)
    assert snapshot is not None and snapshot.version == newest


def _verifies(trust: Trust, store: WeightStore, version: int) -> bool:
    try:
        trust.manifest(store, version)
    except (FormatError, ObjectMissing):
        return False
    return True


def _print(report: AuditReport, events: list[str], seconds: float) -> None:
    print(f"\nchaos run: {seconds:.0f}s")
    for event in events:
        print(f"  {event}")
    for key, value in report.counts().items():
        print(f"  {key:<22} {value}")


def _check(report: AuditReport) -> None:
    delivered = report.delivered
    trained = set(report.trained)
    stale, dlq = set(report.stale.ids), set(report.dlq.ids)
    orphaned = report.produced.orphaned_ids
    assert len(report.produced.delivered) > GROUPS  # the last incarnation's, and earlier ones
    assert not report.produced.pending
    # every delivered trajectory has an outcome ...
    assert delivered - (trained | stale | dlq) == set(), report.problems()
    # ... and exactly one: trained once, never both trained and filtered
    assert report.trained_twice == {}
    assert trained & stale == set()
    assert trained & dlq == set(), {t: report.dlq.reasons[t] for t in trained & dlq}
    # nothing trained that no producer delivered (or left partly in raw by a crash)
    assert trained - delivered - orphaned == set()
    # dead letters: only what the partial-group policy of streams.processor sends there (a
    # group a producer crash left too small, or stale samples took most of; a sample that
    # arrives after its group closed)
    assert set(report.dlq_reasons()) <= {"incomplete_group", "late_sample"}, report.dlq_reasons()
    # the trainer caught up and the stream emitted each group once
    assert report.scored is not None and report.raw is not None
    assert not report.untrained and not report.unprocessed
    assert all(n == 1 for n in report.scored.ids.values())
    assert all(n == 1 for n in report.raw.ids.values())
    assert report.problems() == []
    assert trained, "nothing was trained"
    # no side output doubled by a crash: each stale or filtered trajectory told once
    assert report.stale.ids and report.scored.ids and report.raw.ids
    assert {t: n for t, n in report.stale.ids.items() if n != 1} == {}
    assert {t: n for t, n in report.filtered.ids.items() if n != 1} == {}


def _check_prompt_stats(config: RollstreamConfig) -> None:
    """``prompts.stats`` counts each emitted group's samples once per prompt: the last
    totals of each prompt (added up over the stream's partitions) equal the samples of
    that prompt the stream emitted, to ``rollouts.scored`` or ``rollouts.filtered``."""
    topics = config.streams.topics
    client = config.kafka.client_config()
    emitted: Counter[str] = Counter()
    seen: set[str] = set()
    for msg in read_topic(client, [topics.scored], timeout=60):
        samples = decode_group(msg.value()).samples
        for traj in samples:
            assert traj.trajectory_id not in seen, f"{traj.trajectory_id} scored twice"
            seen.add(traj.trajectory_id)
            emitted[prompt_key(traj.prompt_ids)] += 1
    for msg in read_topic(client, [topics.filtered], timeout=60):
        traj = decode(msg.value())
        assert traj.trajectory_id not in seen, f"{traj.trajectory_id} emitted twice"
        seen.add(traj.trajectory_id)
        emitted[prompt_key(traj.prompt_ids)] += 1
    latest: dict[bytes, PromptStats] = {}
    for msg in read_topic(client, [topics.prompt_stats], timeout=60):
        stats = PromptStats.from_json(msg.value())
        if stats.run_id == RUN:
            latest[msg.key()] = stats
    totals: Counter[str] = Counter()
    for stats in latest.values():
        totals[stats.prompt_key] += stats.samples
    assert emitted, "nothing was emitted"
    assert totals == emitted, {k: (totals[k], emitted[k]) for k in totals | emitted}
