"""The rollout worker against the real Kafka broker: exact delivery, versions and log-probs,
version-change policies, admission control, engine outages, the ledger across kill -9."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from confluent_kafka import Producer
from support.paths import REPO
from support.producer_runs import (
    check_records,
    make_topic,
    read_topic,
    recompute,
    rollout,
    rs_config,
)

from core.models import TinyTokenizer, build_tiny_llama
from core.topic_reader import end_offsets
from infra.topics import ensure_topics
from producers.app import run_producer
from producers.config import EngineConfig, ProducersConfig, SamplingConfig
from producers.engine.engine import Engine, Scheduling
from producers.engine.server import ServerThread
from producers.rollout.ledger import Ledger, ledger_dir, read_ledger, recover
from producers.tasks.base import TaskContext
from producers.tasks.catalog import make_task
from schemas.codec import decode, encode, routing_headers
from schemas.trajectory import Trajectory

torch.set_num_threads(1)

pytestmark = pytest.mark.system

MODELS = {0: build_tiny_llama(seed=0), 1: build_tiny_llama(seed=1)}


# --- helpers ------------------------------------------------------------------------------


def _slowed(holder: dict, step_delay_s: float):
    """An ``on_worker`` hook: keep the worker, and slow its in-process engine's decode steps
    so that a test can act while a group is being generated (a pacing knob of the engine
    object, not a setting of the config)."""

    def hook(worker) -> None:
        worker.backend.engine.step_delay_s = step_delay_s
        holder.update(worker=worker)

    return hook


def check_logprobs(traj: Trajectory, models=MODELS) -> None:
    """Each segment's log-probs equal a plain forward pass of its version's weights."""
    start = 0
    for version, length in zip(traj.segment_versions, traj.segment_lengths, strict=True):
        expected = recompute(models[int(version)], traj.prompt_ids, traj.response_ids)
        got = traj.logp_infer[start : start + length]
        assert list(got) == pytest.approx(expected[start : start + length], abs=1e-5)
        start += length
    assert start == len(traj.response_ids)


# --- delivery ---------------------------------------------------------------------------------


def test_worker_delivers_exactly_n_groups_over_http(kafka_config, unique_name, tmp_path):
    topic = make_topic(kafka_config, unique_name)
    config = rs_config(kafka_config, tmp_path)
    groups, size = 6, 4
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", seed=0)
    with ServerThread(engine) as server:
        settings = ProducersConfig(
            rollout=rollout(topic, engine_url=server.url, groups=groups, max_inflight_groups=3)
        )
        report = asyncio.run(run_producer(config, settings, install_signals=False))
    assert report.groups_delivered == groups
    assert report.trajectories_delivered == groups * size
    messages = read_topic(kafka_config, topic)
    records = check_records(messages, groups, size, config.run_id)
    task = make_task("copy-first-digit-twice", {}, TaskContext(tmp_path))
    for traj in records:
        assert list(traj.segment_versions) == [0]
        assert traj.finish_reason in ("stop", "length")
        assert traj.producer_id == "worker-a" and traj.task == "copy-first-digit-twice"
        check_logprobs(traj)
        reward, details = task.reward(_prompt_of(traj), [int(t) for t in traj.response_ids])
        assert (traj.reward, traj.reward_details) == (reward, details)
    # The ledger lists exactly what the topic holds, with positions.
    state = read_ledger(ledger_dir(config.state_dir, config.run_id, "worker-a") / "ledger.jsonl")
    assert state.pending == {} and state.orphaned == {}
    assert state.delivered_ids == {t.trajectory_id for t in records}
    positions = {(m.partition(), m.offset()) for m in messages}
    assert len(positions) == groups * size


def test_trl_reward_functions_score_groups_on_the_producer(
    kafka_config, unique_name, tmp_path, monkeypatch
):
    """The file task's reward list through a real producer: one async function, one that
    raises on some groups; every group is delivered and each record says what happened."""
    (tmp_path / "my_trl_rewards.py").write_text(
        "import asyncio\n"
        "async def has_target(completions, target, **kwargs):\n"
        "    await asyncio.sleep(0.01)\n"
        "    return [float(t in c) for c, t in zip(completions, target)]\n"
        "def short(completions, prompts, **kwargs):\n"
        "    if prompts[0].startswith('<bos>9'):\n"
        "        raise RuntimeError('cannot score nines')\n"
        "    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"<bos>{a}{b}<sep>", "target": f"{b}{a}"} for a, b in ("12", "93", "45")]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    topic = make_topic(kafka_config, unique_name)
    config = rs_config(kafka_config, tmp_path)
    options = {
        "path": str(tmp_path / "p.jsonl"),
        "tokenizer": "tiny",
        "max_new_tokens": 4,
        "rewards": [
            {"function": "my_trl_rewards:has_target", "weight": 2.0},
            {"function": "my_trl_rewards:short", "timeout_s": 5},
        ],
    }
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", seed=0)
    with ServerThread(engine) as server:
        settings = ProducersConfig(
            rollout=rollout(
                topic,
                engine_url=server.url,
                groups=6,
                max_inflight_groups=3,
                task="file",
                task_options=options,
            )
        )
        report = asyncio.run(run_producer(config, settings, install_signals=False))
    assert report.groups_delivered == 6
    records = check_records(read_topic(kafka_config, topic), 6, 4, config.run_id)
    tok = TinyTokenizer()
    assert {t.reward_details["example_index"] for t in records} == {0, 1, 2}  # seed 1's draw
    for traj in records:
        details, row = traj.reward_details, rows[traj.reward_details["example_index"]]
        text = tok.decode([int(t) for t in traj.response_ids], skip_special_tokens=True)
        expected_target = float(row["target"] in text)
        assert details["rewards"]["has_target"] == expected_target
        if row["prompt"].startswith("<bos>9"):
            assert details["rewards"]["short"] is None and details["reward_failed"]
            assert details["reward_errors"] == {"short": "raised RuntimeError: cannot score nines"}
            assert traj.reward == 2.0 * expected_target
        else:
            assert details["rewards"]["short"] == 1.0 / (1 + len(text))
            assert traj.reward == pytest.approx(2.0 * expected_target + 1.0 / (1 + len(text)))
            assert not details["reward_failed"]


def _prompt_of(traj: Trajectory):
    from producers.tasks.base import Prompt

    digits = [int(t) - 5 for t in traj.prompt_ids[1:-1]]
    return Prompt([int(t) for t in traj.prompt_ids], {"digits": digits, "target": [digits[0]] * 2})


# --- versions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["interrupt", "abort", "finish"])
def test_version_change_policies(kafka_config, unique_name, tmp_path, policy):
    topic = make_topic(kafka_config, unique_name)
    config = rs_config(kafka_config, tmp_path)
    settings = ProducersConfig(
        engine=EngineConfig(seed=0),
        rollout=rollout(
            topic,
            groups=2,
            max_inflight_groups=1,
            version_policy=policy,
            sampling=SamplingConfig(max_new_tokens=12, ignore_eos=True, stop_token_ids=[]),
        ),
    )
    holder = {}

    async def scenario():
        async def new_version_mid_generation():
            while "worker" not in holder:
                await asyncio.sleep(0.005)
            worker = holder["worker"]
            while worker.backend.engine.stats.tokens_generated < 4:  # first group under way
                await asyncio.sleep(0.002)
            await worker.on_new_version(1, MODELS[1].state_dict())

        trigger = asyncio.create_task(new_version_mid_generation())
        report = await run_producer(
            config, settings, install_signals=False, on_worker=_slowed(holder, 0.02)
        )
        await trigger
        return report

    report = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert report.versions_applied == [1]
    records = check_records(read_topic(kafka_config, topic), 2, 4, config.run_id)
    first, second = sorted({t.group_id: t for t in records}.values(), key=lambda t: t.created_at_ms)
    by_group = defaultdict(list)
    for traj in records:
        by_group[traj.group_id].append(traj)
        assert sum(traj.segment_lengths) == len(traj.response_ids) == 12
        check_logprobs(traj)
    for traj in by_group[first.group_id]:
        if policy == "interrupt":  # a partial rollout: old weights, then new weights
            assert list(traj.segment_versions) == [0, 1]
            assert all(n > 0 for n in traj.segment_lengths)
            assert traj.reward_details["interruptions"] == 1
        elif policy == "abort":  # thrown away and regenerated on the new weights
            assert list(traj.segment_versions) == [1]
            assert traj.reward_details["interruptions"] == 1
        else:  # finished on the old weights
            assert list(traj.segment_versions) == [0]
            assert "interruptions" not in traj.reward_details
    for traj in by_group[second.group_id]:
        assert list(traj.segment_versions) == [1]
    assert report.interrupted_samples == (0 if policy == "finish" else 4)


def test_worker_follows_published_weights(kafka_config, s3_config, unique_name, tmp_path):
    from core.config import WeightsConfig
    from schemas.topics import POLICY_VERSIONS
    from weights.announce import Announcer
    from weights.store import WeightStore
    from weights.writer import DeltaWriter

    topic = make_topic(kafka_config, unique_name)
    client = kafka_config.client_config()
    versions_topic = unique_name("policy.versions")
    ensure_topics(client, [dataclasses.replace(POLICY_VERSIONS, name=versions_topic)])
    config = rs_config(kafka_config, tmp_path).model_copy(
        update={
            "s3": s3_config,
            "weights": WeightsConfig(topic=versions_topic, poll_interval_s=1, allow_unsigned=True),
        }
    )
    # The trainer's weights differ from the engine's own (seed 0): only following helps.
    published = {0: build_tiny_llama(seed=2), 1: build_tiny_llama(seed=3)}
    announcer = Announcer(client, versions_topic)
    writer = DeltaWriter(WeightStore.from_config(s3_config, config.run_id), announcer=announcer)
    writer.publish(published[0].state_dict(), 0)
    settings = ProducersConfig(
        engine=EngineConfig(seed=0),
        rollout=rollout(
            topic,
            groups=3,
            max_inflight_groups=1,
            staleness_window=0,
            follow_weights=True,
            sampling=SamplingConfig(max_new_tokens=12, ignore_eos=True, stop_token_ids=[]),
        ),
    )
    holder = {}

    async def scenario():
        async def trainer():
            while "worker" not in holder:
                await asyncio.sleep(0.005)
            worker = holder["worker"]
            while worker.publisher.delivered_groups < 1:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(writer.publish, published[1].state_dict(), 1)

        task = asyncio.create_task(trainer())
        report = await run_producer(
            config, settings, install_signals=False, on_worker=_slowed(holder, 0.01)
        )
        await asyncio.wait_for(task, 60)
        return report

    try:
        report = asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        announcer.close()
    assert report.versions_applied == [0, 1]
    records = check_records(read_topic(kafka_config, topic), 3, 4, config.run_id)
    for traj in records:
        check_logprobs(traj, published)
    ordered = sorted(records, key=lambda t: t.created_at_ms)
    assert list(ordered[0].segment_versions) == [0]
    assert list(ordered[-1].segment_versions) == [1]


def test_an_engine_that_forgets_its_weights_gets_them_again(
    kafka_config, s3_config, unique_name, tmp_path, caplog
):
    """A restarted engine serves its initial weights (v0) again: the worker tags what it
    generated that way honestly and reloads the version it had given the engine."""
    from core.config import WeightsConfig
    from schemas.topics import POLICY_VERSIONS
    from weights.announce import Announcer
    from weights.store import WeightStore
    from weights.writer import DeltaWriter

    topic = make_topic(kafka_config, unique_name)
    client = kafka_config.client_config()
    versions_topic = unique_name("policy.versions")
    ensure_topics(client, [dataclasses.replace(POLICY_VERSIONS, name=versions_topic)])
    config = rs_config(kafka_config, tmp_path).model_copy(
        update={
            "s3": s3_config,
            "weights": WeightsConfig(topic=versions_topic, poll_interval_s=1, allow_unsigned=True),
        }
    )
    # v0 is the engine's own initial model (as in a real run); v1 differs.
    published = {0: build_tiny_llama(seed=0), 1: build_tiny_llama(seed=3)}
    announcer = Announcer(client, versions_topic)
    writer = DeltaWriter(WeightStore.from_config(s3_config, config.run_id), announcer=announcer)
    writer.publish(published[0].state_dict(), 0)
    settings = ProducersConfig(
        engine=EngineConfig(seed=0),
        rollout=rollout(
            topic,
            groups=6,
            max_inflight_groups=1,
            staleness_window=0,
            follow_weights=True,
            sampling=SamplingConfig(max_new_tokens=12, ignore_eos=True, stop_token_ids=[]),
        ),
    )
    holder = {}

    async def scenario():
        async def trainer_and_crash():
            while "worker" not in holder:
                await asyncio.sleep(0.005)
            worker = holder["worker"]
            while worker.publisher.delivered_groups < 1:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(writer.publish, published[1].state_dict(), 1)
            while worker.publisher.delivered_groups < 3:
                await asyncio.sleep(0.005)
            # What a restart leaves behind: the initial model, reporting version 0.
            engine = worker.backend.engine
            initial = build_tiny_llama(seed=0).state_dict()
            await asyncio.wrap_future(engine.update_weights(initial, "0"))

        task = asyncio.create_task(trainer_and_crash())
        report = await run_producer(
            config, settings, install_signals=False, on_worker=_slowed(holder, 0.01)
        )
        await asyncio.wait_for(task, 60)
        return report, holder["worker"].backend

    caplog.set_level("WARNING", logger="producers")
    try:
        report, _backend = asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        announcer.close()
    assert report.versions_applied == [0, 1]
    assert any("restarted?" in r.getMessage() for r in caplog.records)
    records = check_records(read_topic(kafka_config, topic), 6, 4, config.run_id)
    for traj in records:
        check_logprobs(traj, published)  # every tag names the weights that produced it
    last = max(records, key=lambda t: t.created_at_ms)
    assert list(last.segment_versions) == [1], "the engine got version 1 back"


def test_admission_control_waits_for_the_trainer(kafka_config, unique_name, tmp_path):
    topic = make_topic(kafka_config, unique_name)
    config = rs_config(kafka_config, tmp_path)
    # The engine starts at version 1 while the trainer has consumed version 0's data.
    settings = ProducersConfig(
        rollout=rollout(
            topic, groups=3, max_inflight_groups=1, staleness_window=0, initial_version=1
        )
    )
    consumed = [0]
    holder = {}
    seen = {}

    async def scenario():
        async def trainer():
            while "worker" not in holder:
                await asyncio.sleep(0.005)
            worker = holder["worker"]
            while not worker.metrics.get("admission_paused"):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)  # paused means paused: nothing starts meanwhile
            seen["delivered"] = worker.publisher.delivered_groups
            seen["inflight"] = worker.metrics.get("inflight_groups")
            seen["lag"] = worker.metrics.get("consumed_lag")
            consumed[0] = 1  # the trainer caught up

        task = asyncio.create_task(trainer())
        report = await run_producer(
            config,
            settings,
            install_signals=False,
            consumed_version=lambda: consumed[0],
            on_worker=lambda w: holder.update(worker=w),
        )
        await asyncio.wait_for(task, 60)
        return report

    report = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert seen == {"delivered": 0, "inflight": 0, "lag": 1}
    assert report.groups_delivered == 3
    records = check_records(read_topic(kafka_config, topic), 3, 4, config.run_id)
    assert all(list(t.segment_versions) == [1] for t in records)


def test_admission_waits_while_weights_lag_the_announced_version(
    kafka_config, unique_name, tmp_path, caplog
):
    from producers.engine.backends import LocalBackend
    from producers.rollout.admission import TrainerSignals
    from producers.rollout.group_publisher import GroupPublisher
    from producers.rollout.publishing import Outbox, ProducerIdentity
    from producers.rollout.worker import RolloutWorker, WorkerLinks

    topic = make_topic(kafka_config, unique_name)
    announced = [3]  # the weight store is down: v3 announced, the worker still at v0

    async def scenario():
        engine = Engine(build_tiny_llama(seed=0), model_path="tiny", seed=0)
        backend = LocalBackend(engine)
        with Ledger(tmp_path / "ledger") as ledger:
            publisher = GroupPublisher(kafka_config.client_config(), topic, ledger)
            worker = RolloutWorker(
                rollout(topic, staleness_window=1),
                backend,
                make_task("copy-first-digit-twice", {}, TaskContext(tmp_path)),
                Outbox(publisher),
                ProducerIdentity(run_id="r", producer_id="p", region="local"),
                links=WorkerLinks(trainer=TrainerSignals(announced_version=lambda: announced[0])),
            )
            run = asyncio.create_task(worker.run(1))
            while not worker.metrics.get("admission_paused"):
                await asyncio.sleep(0.005)
            lag = worker.metrics.get("version_lag")
            delivered = publisher.delivered_groups
            await worker.on_new_version(2, MODELS[1].state_dict())  # the follower catches up
            report = await asyncio.wait_for(run, 60)
            publisher.close()
        await backend.aclose()
        return lag, delivered, report

    with caplog.at_level("INFO", logger="producers"):
        lag, delivered, report = asyncio.run(scenario())
    assert (lag, delivered) == (3, 0)
    assert "v3 is announced, more than the staleness window (1) behind" in caplog.text
    assert report.groups_delivered == 1 and report.versions_applied == [2]


# --- outages ----------------------------------------------------------------------------------


def test_worker_rides_out_an_engine_outage(kafka_config, unique_name, tmp_path):
    topic = make_topic(kafka_config, unique_name)
    config = rs_config(kafka_config, tmp_path)
    # paced, so that groups are still being generated when the engine goes away (a fast
    # machine could otherwise finish all of them while the server is being stopped)
    engine = Engine(
        build_tiny_llama(seed=0),
        model_path="tiny",
        seed=0,
        scheduling=Scheduling(step_delay_s=0.05),
    )
    servers = [ServerThread(engine).start()]
    port = servers[0].port
    settings = ProducersConfig(
        rollout=rollout(
            topic,
            engine_url=servers[0].url,
            groups=6,
            max_inflight_groups=1,
            retries=2,
            retry_max_wait_s=0.1,
        )
    )
    holder = {}

    async def scenario():
        async def outage():
            while "worker" not in holder:
                await asyncio.sleep(0.005)
            worker = holder["worker"]
            while worker.publisher.delivered_groups < 2:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(servers[0].stop, False)  # the engine goes away
            while not worker.metrics.get("engine_errors_total"):
                await asyncio.sleep(0.01)
            holder["during"] = worker.publisher.delivered_groups
            servers.append(await asyncio.to_thread(ServerThread(engine, port=port).start))

        task = asyncio.create_task(outage())
        report = await run_producer(
            config, settings, install_signals=False, on_worker=lambda w: holder.update(worker=w)
        )
        await task
        return report

    try:
        report = asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        servers[-1].stop()
    assert holder["during"] < 6
    assert report.groups_delivered == 6
    check_records(read_topic(kafka_config, topic), 6, 4, config.run_id)


# --- ledger -----------------------------------------------------------------------------------


def _group(group_id: str, size: int = 3) -> list[Trajectory]:
    return [
        Trajectory.create(
            run_id="r",
            trajectory_id=f"{group_id}-{i}",
            group_id=group_id,
            group_size=size,
            sample_index=i,
            producer_id="p",
            region="local",
            task="t",
            prompt_ids=[1, 5, 3],
            response_ids=[6, 2],
            logp_infer=[-1.0, -2.0],
            segment_versions=[0],
            segment_lengths=[2],
            reward=0.0,
            reward_details={},
            finish_reason="stop",
            created_at_ms=1,
            finished_at_ms=2,
        )
        for i in range(size)
    ]


def test_ledger_recovery_resolves_what_a_crash_left_pending(kafka_config, unique_name, tmp_path):
    topic = make_topic(kafka_config, unique_name, partitions=3)
    client = kafka_config.client_config()
    producer = Producer({**client, "enable.idempotence": True})
    # Records from before this producer's session: the scan starts after them.
    for traj in _group("older"):
        producer.produce(topic, encode(traj), b"older", headers=routing_headers(traj))
    producer.flush(30)
    with Ledger(tmp_path) as ledger:
        ledger.mark(end_offsets(client, topic))
        for gid, produced in (("partial", 2), ("complete", 3), ("missing", 0), ("done", 3)):
            group = _group(gid)
            ledger.pending(gid, [t.trajectory_id for t in group])
            for traj in group[:produced]:
                producer.produce(topic, encode(traj), gid.encode(), headers=routing_headers(traj))
        producer.flush(30)
        ledger.delivered("done", [t.trajectory_id for t in _group("done")], [(0, 0)] * 3)
    # A crash mid-write leaves a torn line behind.
    with (tmp_path / "ledger.jsonl").open("ab") as fh:
        fh.write(b'{"kind": "delivered", "group_id": "parti')
    with Ledger(tmp_path) as ledger:
        assert set(ledger.state.pending) == {"partial", "complete", "missing"}
        report = recover(ledger, client, topic)
        assert (report.delivered, report.orphaned, report.lost) == (1, 1, 1)
    state = read_ledger(tmp_path / "ledger.jsonl")
    assert state.pending == {}
    assert set(state.delivered) == {"done", "complete"}
    assert state.orphaned == {"partial": ["partial-0", "partial-1"]}
    assert state.lost == {"missing"}
    assert (tmp_path / "ledger.jsonl").read_bytes().endswith(b"\n")


def test_ledger_is_exclusive(tmp_path):
    from producers.rollout.ledger import LedgerLocked

    with Ledger(tmp_path), pytest.raises(LedgerLocked, match="another process"):
        Ledger(tmp_path).open()


# --- the worker as a process: kill -9, SIGTERM ------------------------------------------------


def _spawn(
    kafka_config,
    tmp_path: Path,
    run_id: str,
    topic: str,
    groups: int,
    stop_policy: str = "abort",
    task_options: str = "",
):
    """A producer process; ``task_options`` (a ``[producers.rollout.task_options]`` table)
    gives it the file task instead of the default."""
    settings = tmp_path / "rollstream.toml"
    settings.write_text(
        textwrap.dedent(
            f"""
            [producers.engine]
            model = "tiny"
            torch_threads = 1
            [producers.rollout]
            topic = "{topic}"
            groups = {groups}
            group_size = 4
            max_inflight_groups = 2
            producer_id = "worker-k"
            progress = false
            follow_weights = false
            stop_policy = "{stop_policy}"
            # no trainer: credit for as many groups as asked, so that generation never
            # pauses on it and groups are in flight whenever the signal comes
            groups_per_version = {groups}
            """
        )
        + (f'task = "file"\n{task_options}' if task_options else "")
    )
    env = {
        **os.environ,
        "ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": kafka_config.bootstrap_servers,
        "ROLLSTREAM_STATE_DIR": str(tmp_path / "state"),
        "ROLLSTREAM_RUN_ID": run_id,
        "ROLLSTREAM_S3__EMBEDDED": "false",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "producers", "--config", str(settings)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_for_deliveries(ledger_file: Path, at_least: int, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read().decode()[-3000:])
        if ledger_file.exists() and len(read_ledger(ledger_file).delivered) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} deliveries in {timeout}s")


def _ledger_matches_topic(kafka_config, topic: str, ledger_file: Path) -> tuple[int, int]:
    """The ledger and the topic agree group by group, and no record is in the topic twice
    (counted, so a group re-sent after a crash cannot hide behind its first copy)."""
    state = read_ledger(ledger_file)
    assert state.pending == {}, "recovery left groups pending"
    records = [decode(message.value()) for message in read_topic(kafka_config, topic)]
    copies = Counter(traj.trajectory_id for traj in records)
    twice = {tid: n for tid, n in copies.items() if n > 1}
    assert not twice, f"records in the topic more than once: {twice}"
    by_group = defaultdict(set)
    for traj in records:
        by_group[traj.group_id].add(traj.trajectory_id)
    complete = {g: ids for g, ids in by_group.items() if len(ids) == 4}
    partial = {g: ids for g, ids in by_group.items() if len(ids) < 4}
    assert set(state.delivered) == set(complete)
    assert state.delivered_ids == set().union(*complete.values())
    assert {g: set(ids) for g, ids in state.orphaned.items()} == partial
    assert not (set(state.lost) & set(by_group))
    return len(complete), len(partial)


def test_the_ledger_check_sees_a_group_produced_twice(kafka_config, unique_name, tmp_path):
    """The kill tests' only check must fail on a group the topic holds twice (a pending
    group re-sent after the kill), though every group is complete and in the ledger."""
    topic = make_topic(kafka_config, unique_name, partitions=2)
    producer = Producer({**kafka_config.client_config(), "enable.idempotence": True})
    with Ledger(tmp_path) as ledger:
        for gid, sends in (("once", 1), ("twice", 2)):
            group = _group(gid, size=4)
            ledger.pending(gid, [t.trajectory_id for t in group])
            for _ in range(sends):
                for traj in group:
                    producer.produce(
                        topic, encode(traj), gid.encode(), headers=routing_headers(traj)
                    )
            assert producer.flush(30) == 0
            ledger.delivered(gid, [t.trajectory_id for t in group], [(0, 0)] * 4)
    with pytest.raises(AssertionError, match=r"more than once.*twice-0"):
        _ledger_matches_topic(kafka_config, topic, tmp_path / "ledger.jsonl")


def _kill_9_then_restart(
    kafka_config, tmp_path: Path, topic: str, deliveries: int, groups: int, task_options: str = ""
) -> tuple[Path, int, str]:
    """A producer killed with SIGKILL after ``deliveries`` groups, then a second one on
    the same ledger asked for ``groups``: the ledger file, the groups delivered before
    the kill, and the second producer's output (it must exit 0)."""
    run_id = f"run-{uuid.uuid4().hex[:6]}"
    ledger_file = ledger_dir(tmp_path / "state", run_id, "worker-k") / "ledger.jsonl"
    first = _spawn(kafka_config, tmp_path, run_id, topic, groups=100_000, task_options=task_options)
    try:
        _wait_for_deliveries(ledger_file, deliveries, first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    delivered_before = len(read_ledger(ledger_file).delivered)
    second = _spawn(kafka_config, tmp_path, run_id, topic, groups=groups, task_options=task_options)
    output = second.communicate(timeout=300)[0].decode()
    assert second.returncode == 0, output[-3000:]
    return ledger_file, delivered_before, output


def test_kill_9_and_restart_keep_ledger_and_topic_in_agreement(kafka_config, unique_name, tmp_path):
    topic = make_topic(kafka_config, unique_name)
    ledger_file, delivered_before, output = _kill_9_then_restart(
        kafka_config, tmp_path, topic, deliveries=3, groups=2
    )
    assert "delivered 2 group(s), 8 record(s)" in output
    complete, _ = _ledger_matches_topic(kafka_config, topic, ledger_file)
    assert complete >= delivered_before + 2


@pytest.mark.parametrize("stop_policy", ["abort", "finish"])
def test_sigterm_stops_cleanly(kafka_config, unique_name, tmp_path, stop_policy):
    topic = make_topic(kafka_config, unique_name)
    run_id = f"run-{uuid.uuid4().hex[:6]}"
    ledger_file = ledger_dir(tmp_path / "state", run_id, "worker-k") / "ledger.jsonl"
    process = _spawn(kafka_config, tmp_path, run_id, topic, groups=100_000, stop_policy=stop_policy)
    try:
        _wait_for_deliveries(ledger_file, 2, process)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0].decode()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM received" in output
    complete, partial = _ledger_matches_topic(kafka_config, topic, ledger_file)
    assert partial == 0 and complete >= 2
    state = read_ledger(ledger_file)
    assert len(state.orphaned) == 0
    # The last line says what became of the groups in flight at the signal.
    (stop,) = state.stops
    assert stop.finished or stop.aborted  # two groups are always in flight (max_inflight)
    assert stop.policy == stop_policy and stop.unacknowledged == []
    assert set(stop.finished) <= set(state.delivered)  # finished ones are in the topic
    assert not set(stop.aborted) & set(state.delivered)  # aborted ones never are
    if stop_policy == "finish":
        assert stop.aborted == []
    in_topic = {decode(m.value()).group_id for m in read_topic(kafka_config, topic)}
    assert not set(stop.aborted) & in_topic


def test_a_dataset_walked_in_epochs_survives_kill_9(kafka_config, unique_name, tmp_path):
    """``order = "epochs"``: across a kill -9 and a restart, the delivered groups' prompt
    positions are 0, 1, 2, ... with none skipped and none given twice, each the row its
    epoch's shuffle puts there."""
    rows = [
        {"prompt_ids": [1, 5 + a, 5 + b, 3], "solution": f"{b}{a}"}
        for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 1))
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    task = textwrap.dedent(
        f"""
        [producers.rollout.task_options]
        path = "{data}"
        tokenizer = "tiny"
        max_new_tokens = 3
        order = "epochs"
        shuffle_seed = 7
        rewards = [{{ function = "producers.tasks.math_reward:math_accuracy" }}]
        """
    )
    topic = make_topic(kafka_config, unique_name)
    ledger_file, _, _ = _kill_9_then_restart(
        kafka_config, tmp_path, topic, deliveries=4, groups=3, task_options=task
    )
    complete, _ = _ledger_matches_topic(kafka_config, topic, ledger_file)
    records = [decode(m.value()) for m in read_topic(kafka_config, topic)]
    delivered = read_ledger(ledger_file).delivered
    positions = {}
    for traj in records:
        if traj.group_id in delivered:
            positions.setdefault(traj.group_id, set()).add(
                (traj.reward_details["prompt_position"], traj.reward_details["example_index"])
            )
    assert all(len(found) == 1 for found in positions.values())  # one prompt a group
    walked = sorted(found.pop() for found in positions.values())
    assert [position for position, _ in walked] == list(range(complete))
    assert complete >= 4 + 3
    order = [
        index
        for epoch in range(complete // len(rows) + 1)
        for index in _epoch_order(len(rows), 7, epoch)
    ]
    assert [index for _, index in walked] == order[:complete]


def _epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    import random

    order = list(range(size))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
