"""``rollstream fork`` on the real broker and the real S3 server.

One recorded run (a trainer subprocess: 30 steps of two micro-batches each, deterministic,
a version published after every step) is forked three ways:

- a control arm, killed by a failpoint right after its checkpoint of step 10, stopped
  (SIGTERM: it exits 1) after that of step 15, and run again: every version 0..30 is
  RUN's bit for bit (``state_sha256``), every step trained exactly RUN's samples once,
  its metrics are RUN's, and neither RUN's files, RUN's weights nor any topic changed; a
  control arm that differs (RUN as if trained without ``deterministic``) exits 1;
- a counterfactual arm from RUN's checkpoint of step 10 with three times the learning rate:
  version 10 is RUN's, every later one differs, and it ends further from the generating
  policy than RUN (``offpolicy/k3_kl``);
- garbage: a fork named like its run, steps RUN never trained, a checkpoint RUN no longer
  keeps, a malformed ``--set``, a name taken by another fork or by a run, a RUN that is
  no run, a fork, or not the config's; none writes anything.

``fork --list`` lists both arms; ``report RUN ctl lr`` overlays the three runs; ``eval
--stored`` measures RUN's and the control arm's versions alike. A fork started while its
run is still training (``--follow``) trains the steps the run records after its start too.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import orjson
import pytest
import torch
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition
from support.paths import REPO
from support.synthetic import synthetic_groups
from support.trainer_runs import (
    group_records,
    make_topics,
    produce,
    spawn,
    trainer_config,
    write_toml,
)

from consumers.checkpoint import LedgerStep, TrainingLedger
from consumers.config import TrainerConfig
from consumers.trainer import FAILPOINT_ENV
from core.config import KafkaConfig, S3Config
from core.models import load_model
from rollstream.cli.main import main
from rollstream.config.settings import ConfigSources
from rollstream.runs.fork import forked_config
from rollstream.runs.report import load_metrics
from weights.manifest import Manifest
from weights.store import WeightStore
from weights.writer import DeltaWriter

RUN = "fork-source"
STEPS = 30
IGNORED = ("time/", "throughput/", "lag/")  # wall clock and broker position, not training


def rollstream(
    config: Path, *args: str, failpoint: str | None = None, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    if failpoint is not None:
        env[FAILPOINT_ENV] = failpoint
    return subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def end_offsets(kafka: KafkaConfig, topics: list[str]) -> dict[tuple[str, int], int]:
    consumer = Consumer({**kafka.client_config(), "group.id": "fork-test-ends"})
    try:
        ends = {}
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            for p in meta.partitions:
                ends[(topic, p)] = consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=10
                )[1]
        return ends
    finally:
        consumer.close()


def digests(store: WeightStore) -> dict[int, str]:
    return {v: Manifest.from_bytes(store.read_manifest(v)).state_sha256 for v in store.versions()}


def metric_rows(path: Path) -> dict[int, dict[str, float]]:
    """The last row of each step, without wall-clock and broker-position metrics."""
    return {
        int(row["step"]): {k: v for k, v in row.items() if not k.startswith(IGNORED)}
        for row in load_metrics(path.parent.name, [path]).rows
    }


def run_config(
    tmp: Path,
    run: str,
    kafka: KafkaConfig,
    s3: S3Config,
    trainer: dict,
    keep_versions: int = 16,
    **sections: object,
) -> Path:
    """The config file of a recorded run's trainer subprocess (and of its forks)."""
    config = tmp / "rollstream.toml"
    weights = {"max_delta_fraction": 1.0, "allow_unsigned": True, "keep_versions": keep_versions}
    write_toml(
        config,
        {
            "run_id": run,
            "state_dir": str(tmp / "state"),
            "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
            "s3": s3.file_table(),
            "presence": {"enabled": False},
            "trainer": trainer,
            "weights": weights,
            **sections,
        },
    )
    return config


class Recorded:
    def __init__(self, tmp: Path, config: Path, topics: dict[str, str], s3: S3Config) -> None:
        self.tmp, self.config, self.topics, self.s3 = tmp, config, topics, s3
        self.state = tmp / "state"
        self.ledger = tmp / "ledger.jsonl"
        self.metrics = tmp / "metrics.jsonl"

    def store(self, run: str) -> WeightStore:
        return WeightStore.from_config(self.s3, run)

    def home(self, run: str) -> Path:
        return self.state / "trainer" / run


@pytest.fixture(scope="module")
def recorded(
    kafka_config: KafkaConfig,
    module_s3_config: S3Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> Recorded:
    """RUN: 30 steps of 2 micro-batches of one group, trained by a trainer subprocess on
    groups whose old log-probs are the initial model's (version 0 generated them)."""
    tmp = tmp_path_factory.mktemp("fork")
    suffix = uuid.uuid4().hex[:8]
    topics = make_topics(kafka_config, lambda base: f"{base}-{suffix}")
    trainer = trainer_config(
        tmp,
        topics,
        max_steps=STEPS,
        engine={"lr": 1e-3, "bf16": True, "deterministic": True, "grad_accum_steps": 2},
        batch={"max_groups": 1, "max_wait_s": 30.0},
        checkpoint={"dir": str(tmp / "ckpt"), "every": 5, "keep": 4},
        publish={"every": 1},
    )
    model = load_model(TrainerConfig.model_validate(trainer).model.spec)
    groups = synthetic_groups(2 * STEPS, seed=41, run_id=RUN, model=model)
    # one partition: the recorded run trains the groups in the order they were produced
    produce(kafka_config, topics["scored"], group_records(groups), partition=0)
    config = run_config(
        tmp,
        RUN,
        kafka_config,
        module_s3_config,
        trainer,
        keep_versions=100,
        # the held-out measure of each arm's versions (`eval --stored`)
        producers={
            "rollout": {"task": "reverse-3-digits", "task_options": {"eval_size": 8}},
            "eval": {"every_versions": 10},
        },
    )
    log = tmp / "trainer.log"
    assert spawn(config, log).wait(600) == 0, log.read_text()[-4000:]
    return Recorded(tmp, config, topics, module_s3_config)


@pytest.mark.system
def test_a_control_fork_killed_and_resumed_is_the_run_bit_for_bit(
    recorded: Recorded, kafka_config: KafkaConfig
) -> None:
    run_steps = TrainingLedger.read_steps(recorded.ledger)
    assert [s.step for s in run_steps] == list(range(1, STEPS + 1))
    assert all(s.micro_batches and len(s.micro_batches) == 2 for s in run_steps)
    run_files = tree_digest(recorded.tmp / "ckpt") | {
        "ledger": hashlib.sha256(recorded.ledger.read_bytes()).hexdigest(),
        "metrics": hashlib.sha256(recorded.metrics.read_bytes()).hexdigest(),
    }
    run_versions = digests(recorded.store(RUN))
    assert sorted(run_versions) == list(range(STEPS + 1))
    topics = list(recorded.topics.values())
    ends = end_offsets(kafka_config, topics)

    killed = rollstream(
        recorded.config, "fork", RUN, "--as", "ctl", failpoint="after_checkpoint:10"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert "failpoint after_checkpoint:10" in killed.stderr
    stopped = rollstream(
        recorded.config, "fork", RUN, "--as", "ctl", failpoint="after_checkpoint:15:stop"
    )
    assert stopped.returncode == 1, stopped.stderr[-4000:]  # a stopped fork is no success
    assert "restored step 10" in stopped.stderr
    assert "fork ctl was stopped at step 15: run the same command again" in stopped.stderr
    resumed = rollstream(recorded.config, "fork", RUN, "--as", "ctl")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "restored step 15" in resumed.stderr
    assert f"identical to {RUN}'s: {STEPS + 1}; different: 0" in resumed.stdout

    assert digests(recorded.store("ctl")) == run_versions  # every version, bit for bit
    home = recorded.home("ctl")
    forked = TrainingLedger.read_steps(home / "ledger.jsonl")
    assert [(s.step, s.trajectory_ids, s.micro_batches) for s in forked] == [
        (s.step, s.trajectory_ids, s.micro_batches) for s in run_steps
    ]  # each step once, after the kill too
    assert metric_rows(home / "metrics.jsonl") == metric_rows(recorded.metrics)
    manifest = orjson.loads((home / "fork.json").read_bytes())
    assert (manifest["run"], manifest["from_step"], manifest["to_step"]) == (RUN, 0, STEPS)
    # nothing of RUN's changed, nothing was written to any topic
    assert (
        tree_digest(recorded.tmp / "ckpt")
        | {
            "ledger": hashlib.sha256(recorded.ledger.read_bytes()).hexdigest(),
            "metrics": hashlib.sha256(recorded.metrics.read_bytes()).hexdigest(),
        }
        == run_files
    )
    assert digests(recorded.store(RUN)) == run_versions
    assert end_offsets(kafka_config, topics) == ends

    # the held-out eval of each lineage's stored versions: the same weights, the same rows
    evaluated = {}
    for run in (RUN, "ctl"):
        done = CliRunner().invoke(
            main, ["--config", str(recorded.config), "eval", "--stored", "--run", run]
        )
        assert done.exit_code == 0 and "evaluated 4 version(s)" in done.output, done.output
        rows = load_metrics(run, [recorded.state / "eval" / run / "metrics.jsonl"]).rows
        evaluated[run] = [{k: v for k, v in r.items() if k != "eval/seconds"} for r in rows]
    assert [r["version"] for r in evaluated["ctl"]] == [0, 10, 20, 30]
    assert evaluated["ctl"] == evaluated[RUN]


@pytest.mark.system
def test_a_counterfactual_fork_from_a_checkpoint_diverges_and_says_how_far_off_policy(
    recorded: Recorded, tmp_path: Path
) -> None:
    done = rollstream(
        recorded.config,
        "fork",
        RUN,
        "--as",
        "lr",
        "--set",
        "trainer.engine.lr=3e-3",
        "--from-step",
        "20",
        "--to-step",
        "28",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run_versions, fork_versions = digests(recorded.store(RUN)), digests(recorded.store("lr"))
    assert sorted(fork_versions) == list(range(20, 29))
    assert fork_versions[20] == run_versions[20]  # RUN's checkpoint, optimiser state and all
    assert all(fork_versions[v] != run_versions[v] for v in range(21, 29))
    ledger = TrainingLedger.read(recorded.home("lr") / "ledger.jsonl")
    assert ledger == TrainingLedger.read(recorded.ledger)[:28]  # RUN's 1..20, then the same data
    ours, theirs = metric_rows(recorded.home("lr") / "metrics.jsonl"), metric_rows(recorded.metrics)
    assert sorted(ours) == list(range(21, 29))
    for step in range(21, 29):
        assert ours[step]["reward/mean"] == theirs[step]["reward/mean"]  # the same data
    assert ours[21]["offpolicy/k3_kl"] == pytest.approx(theirs[21]["offpolicy/k3_kl"])
    assert ours[28]["offpolicy/k3_kl"] > theirs[28]["offpolicy/k3_kl"] > 0

    listed = rollstream(recorded.config, "fork", RUN, "--list")
    assert listed.returncode == 0, listed.stderr
    assert "trainer.engine.lr=3e-3" in listed.stdout and "lr: steps 21..28" in listed.stdout

    evaluated = CliRunner().invoke(
        main,
        ["--config", str(recorded.config), "eval", "--stored", "--run", "lr", "--versions", "28"],
    )
    assert evaluated.exit_code == 0, evaluated.output
    out = tmp_path / "compare"
    overlaid = rollstream(recorded.config, "report", RUN, "lr", "--out", str(out))
    assert overlaid.returncode == 0, overlaid.stderr[-2000:]
    page = (out / "compare.html").read_text()
    series = orjson.loads(page.split('id="rollstream-series">')[1].split("</script>")[0])
    assert set(series) == {RUN, "lr"}
    assert series["lr"]["offpolicy/k3_kl"]["step"] == list(range(21, 29))
    assert series["lr"]["eval/reward/mean"]["step"] == [28]  # the arm's held-out measure
    assert (out / "compare.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.system
def test_a_control_fork_that_differs_from_its_run_fails_and_says_why(recorded: Recorded) -> None:
    """RUN as if trained without ``deterministic`` (and with another lr, so that this fork
    does differ): a control fork (no ``fork --set``) that differs is no success."""
    drift = ("--set", "trainer.engine.deterministic=false", "--set", "trainer.engine.lr=3e-3")
    done = rollstream(recorded.config, *drift, "fork", RUN, "--as", "drift", "--from-step", "25")
    assert done.returncode == 1, done.stderr[-4000:]
    assert "identical to fork-source's: 1; different: 5 (first 26)" in done.stdout
    assert (
        "this control fork differs from fork-source from version 26 on: fork-source's trainer "
        "ran without [trainer.engine] deterministic"
    ) in done.stderr


def of_run(*args: str) -> list[str]:
    return ["fork", RUN, *args]


WINDOW, ACCUMULATION = "streams.staleness.max_staleness", "trainer.engine.grad_accum_steps"
GHOST = ["--set", "run_id=ghost", "--set", "trainer.ledger_file={tmp}/ghost.jsonl"]


@pytest.mark.system
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (of_run("--as", RUN), "a run id of its own"),
        (of_run("--as", "x1", "--to-step", "99"), "not within run"),
        (of_run("--as", "x2", "--from-step", "3"), "no checkpoint of step 3"),
        (of_run("--as", "x3", "--set", "trainer.engine.lr"), "expected KEY=VALUE"),
        (of_run("--as", "x4", "--set", "run_id=other"), "the fork's own"),
        (of_run("--as", "x5", "--set", "trainer.engine.lr=-1"), "lr"),
        (of_run("--as", "taken", "--set", "trainer.engine.lr=1e-2"), "other settings"),
        (of_run("--as", "x6", "--set", "trainer.loss.type=nonsense"), "invalid configuration"),
        (of_run(), "--as NEW is required"),
        (
            of_run("--as", "x7", "--set", "streams.staleness.max_staleness=0"),
            "only with --restream",
        ),
        (
            of_run("--as", "x8", "--restream", "--set", "streams.staleness.max_staleness=-1"),
            "invalid",
        ),
        (of_run("--as", "x9", "--restream"), "cannot restream"),  # RUN never had a raw topic
        # NEW names a run already: its weight lineage, its `up` run directory
        (of_run("--as", "lineage"), "lineage is a run of its own (versions 0..1 in the weight"),
        (of_run("--as", "up-run"), "up-run is a run of its own ("),
        # RUN is no run, a fork, or another run than the config's
        (["fork", "nosuchrun", "--as", "x10"], "no run 'nosuchrun'"),
        (["fork", "taken", "--as", "x11"], "taken is a fork of fork-source: fork fork-source"),
        (["fork", "lineage", "--as", "x12"], "this config is run fork-source's, not lineage's"),
        # a run `up` made is found by its id, its own file read
        (["fork", "up-run", "--as", "x15"], "run up-run has no ledger at {tmp}/state/runs/up-run"),
        (
            of_run("--as", "x13", "--set", "trainer.engine.grad_accum_steps=1"),
            "grad_accum_steps is 1",
        ),
        # found wanting once training starts (its samples are not on the topic): removed
        ([*GHOST, "fork", "ghost", "--as", "x14"], "samples of run 'ghost' that steps [1] trained"),
    ],
)
def test_a_fork_that_cannot_be_made_says_why_and_writes_nothing(
    recorded: Recorded, args: list[str], message: str
) -> None:
    taken = recorded.home("taken")
    taken.mkdir(parents=True, exist_ok=True)
    (taken / "fork.json").write_bytes(
        orjson.dumps({"run": RUN, "fork": "taken", "policy": "", "from_step": 0, "to_step": 30})
    )
    lineage = recorded.store("lineage")
    if not lineage.versions():  # a run's lineage and nothing else of it here
        writer = DeltaWriter(lineage)
        for version in (0, 1):
            writer.publish({"w": torch.full((4,), float(version))}, version)
    (recorded.state / "runs" / "up-run").mkdir(parents=True, exist_ok=True)
    up_run = tomllib.loads(recorded.config.read_text())  # as `up` writes it: files in its dir
    up_run["run_id"] = "up-run"
    for key in ("ledger_file", "metrics_file"):
        up_run["trainer"][key] = str(recorded.state / "runs" / "up-run" / f"{key[:-5]}.jsonl")
    write_toml(recorded.state / "runs" / "up-run" / "rollstream.toml", up_run)
    ghost = TrainingLedger(recorded.tmp / "ghost.jsonl")  # steps of samples never recorded
    if not ghost.path.exists():
        ghost.append([LedgerStep(1, ["g1", "g2"], [["g1"], ["g2"]], [])])
    versions = {run: recorded.store(run).versions() for run in ("x10", "x13", "x14", "x15")}
    before = tree_digest(recorded.state)
    given = [a.format(tmp=recorded.tmp) for a in args]
    done = CliRunner().invoke(main, ["--config", str(recorded.config), *given])
    assert done.exit_code in (1, 2), done.output
    assert message.format(tmp=recorded.tmp) in done.output
    assert not isinstance(done.exception, Exception) or isinstance(done.exception, SystemExit)
    assert tree_digest(recorded.state) == before
    assert {run: recorded.store(run).versions() for run in versions} == versions


def test_a_fork_of_another_loss_type_starts_from_that_loss_s_defaults(tmp_path: Path) -> None:
    """RUN's decoupled settings do not leak into a GRPO fork; a tweak of RUN's own loss
    keeps the rest of RUN's settings."""
    config = tmp_path / "rollstream.toml"
    write_toml(
        config,
        {"run_id": RUN, "trainer": {"loss": {"type": "decoupled", "correction": "tis"}}},
    )
    sources = ConfigSources(config, {}, None)
    recorded = sources.resolve(run_id=RUN)
    grpo = forked_config(sources, recorded, {"trainer": {"loss": {"type": "grpo"}}}, "g")
    assert grpo.trainer.loss.type == "grpo" and grpo.run_id == "g"
    assert grpo.trainer.model_dump(exclude={"loss"}) == recorded.trainer.model_dump(
        exclude={"loss"}
    )
    tweak = {"trainer": {"loss": {"level": "sequence"}}}
    tweaked = forked_config(sources, recorded, tweak, "t").trainer.loss
    assert (tweaked.type, tweaked.correction, tweaked.level) == ("decoupled", "tis", "sequence")


@pytest.mark.system
def test_a_fork_follows_a_run_that_is_still_training(
    kafka_config: KafkaConfig, module_s3_config: S3Config, tmp_path: Path
) -> None:
    """RUN has data for 4 of its 8 steps when the fork starts with ``--follow``; the groups
    of steps 5-6 arrive as the fork starts (read with its first read of the topic, before
    RUN's ledger names them), those of 7-8 once the fork has trained step 4 (read by a
    later read). Every version is RUN's, and the fork ends at RUN's ``max_steps`` without
    waiting for the idle timeout."""
    import time

    run, steps = "follow-source", 8
    topics = make_topics(kafka_config, lambda base: f"{base}-{uuid.uuid4().hex[:8]}")
    trainer = trainer_config(
        tmp_path,
        topics,
        max_steps=steps,
        engine={"lr": 1e-3, "bf16": True, "deterministic": True},
        batch={"max_groups": 1, "max_wait_s": 30.0},
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 2},
        publish={"every": 1},
    )
    model = load_model(TrainerConfig.model_validate(trainer).model.spec)
    groups = synthetic_groups(steps, seed=43, run_id=run, model=model)
    config = run_config(tmp_path, run, kafka_config, module_s3_config, trainer)
    produce(kafka_config, topics["scored"], group_records(groups[:4]), partition=0)
    source = spawn(config, tmp_path / "trainer.log")
    ledger = tmp_path / "ledger.jsonl"
    fork = None
    try:
        deadline = time.monotonic() + 300
        while len(TrainingLedger.read(ledger)) < 4:  # RUN's checkpoint of step 4
            assert source.poll() is None and time.monotonic() < deadline, (
                tmp_path / "trainer.log"
            ).read_text()[-4000:]
            time.sleep(0.5)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        following = ("--as", "fol", "--follow", "--follow-idle", "240")
        fork = subprocess.Popen(
            [sys.executable, "-m", "rollstream", "--config", str(config), "fork", run, *following],
            cwd=REPO,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        home = tmp_path / "state" / "trainer" / "fol"
        while not (home / "fork.json").is_file():  # started with RUN's ledger at step 4
            assert fork.poll() is None and time.monotonic() < deadline, fork.communicate()
            time.sleep(0.2)
        produce(kafka_config, topics["scored"], group_records(groups[4:6]), partition=0)
        while len(TrainingLedger.read(home / "ledger.jsonl")) < 4:  # the fork's checkpoint
            assert fork.poll() is None and time.monotonic() < deadline, fork.communicate()
            time.sleep(0.2)
        produce(kafka_config, topics["scored"], group_records(groups[6:]), partition=0)
        assert source.wait(300) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
        out, err = fork.communicate(timeout=300)
    finally:
        for process in (source, fork):
            if process is not None and process.poll() is None:
                process.kill()
    assert fork.returncode == 0, err[-4000:]
    assert f"identical to {run}'s: {steps + 1}; different: 0" in out
    versions = digests(WeightStore.from_config(module_s3_config, "fol"))
    assert versions == digests(WeightStore.from_config(module_s3_config, run))
    assert sorted(versions) == list(range(steps + 1))
    assert TrainingLedger.read(home / "ledger.jsonl") == TrainingLedger.read(ledger)
    manifest = orjson.loads((home / "fork.json").read_bytes())
    assert (manifest["follow"], manifest["to_step"]) == (True, None)
    listed = rollstream(config, "fork", run, "--list")
    assert "fol: steps 1..(following), trained to 8" in listed.stdout, listed.stderr
