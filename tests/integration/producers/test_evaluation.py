"""``rollstream eval``: the held-out split, measured at every N-th version of a real weight
store on the real broker and S3, never published for training; and its parts with garbage."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from support.tracking import tensorboard_scalars

from core.config import TrackingConfig, WeightsConfig, default_cache_dir
from core.models import build_tiny_llama
from infra.topics import ensure_topics
from producers.config import (
    EngineConfig,
    EvalConfig,
    ProducersConfig,
    RolloutConfig,
    SamplingConfig,
)
from producers.engine.backends import LocalBackend
from producers.engine.engine import engine_from_config
from producers.evaluation import (
    DueVersions,
    EvalError,
    Evaluator,
    evaluated_versions,
    run_evaluator,
    summarize,
)
from producers.tasks.base import TaskContext
from producers.tasks.file import file_task
from producers.tasks.rewards import Score
from rollstream.config.settings import RollstreamConfig
from rollstream.runs.report import load_metrics

torch.set_num_threads(1)

REWARDS = (
    "def first_token(completion_ids, **kwargs):\n"
    "    return [ids[0] / 16 if ids else 0.0 for ids in completion_ids]\n"
    "def target_seen(completions, target, **kwargs):\n"
    "    return [float(t in c) for c, t in zip(completions, target)]\n"
)


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def data(tmp_path: Path, monkeypatch) -> dict:
    """A training file and an eval file of tiny-vocabulary prompts, and reward functions."""
    (tmp_path / "eval_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    train = [{"prompt": f"<bos>{a}{b}<sep>", "target": f"{b}{a}"} for a, b in ("12", "34")]
    held = [{"prompt": f"<bos>{a}{b}<sep>", "target": f"{b}{a}"} for a, b in ("56", "78", "90")]
    return {
        "path": str(_write_rows(tmp_path / "train.jsonl", train)),
        "eval_path": str(_write_rows(tmp_path / "eval.jsonl", held)),
        "tokenizer": "tiny",
        "max_new_tokens": 4,
        "rewards": [
            {"function": "eval_rewards:first_token"},
            {"function": "eval_rewards:target_seen", "weight": 2.0},
        ],
    }


def _context() -> TaskContext:
    return TaskContext(default_cache_dir(), None)


# --- the eval split of the file task -----------------------------------------------------


@pytest.mark.unit
def test_the_file_task_keeps_its_eval_split_apart(data):
    task = file_task(_context(), **data)
    prompts = task.eval_prompts()
    assert [p.meta["example"]["target"] for p in prompts] == ["65", "87", "09"]
    # training never samples an eval row
    import random

    rng = random.Random(0)
    assert {task.sample(rng).meta["example"]["target"] for _ in range(50)} == {"21", "43"}


@pytest.mark.unit
def test_a_datasets_dictionary_gives_its_test_split(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"prompt_ids": [[1, 5], [1, 6], [1, 7]]}
    DatasetDict(
        {"train": Dataset.from_dict(rows), "test": Dataset.from_dict({"prompt_ids": [[1, 9]]})}
    ).save_to_disk(str(tmp_path / "ds"))
    options = {"path": str(tmp_path / "ds"), "split": "train", "reward": "math:fsum"}
    task = file_task(_context(), **options, eval_split="test")
    assert [p.ids for p in task.eval_prompts()] == [[1, 9]]
    with pytest.raises(ValueError, match="the eval split is the training data"):
        file_task(_context(), **options, eval_split="train")
    with pytest.raises(ValueError, match="'validation' is not one"):
        file_task(_context(), **options, eval_split="validation")


@pytest.mark.unit
def test_garbage_eval_options_are_refused_clearly(data, tmp_path):
    no_eval = {k: v for k, v in data.items() if k != "eval_path"}
    with pytest.raises(ValueError, match="has no eval split"):
        file_task(_context(), **no_eval).eval_prompts()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"eval split of .* holds no examples"):
        file_task(_context(), **{**data, "eval_path": str(tmp_path / "empty.jsonl")})
    (tmp_path / "bad.jsonl").write_text('{"question": "no prompt column"}\n')
    with pytest.raises(ValueError, match="none of the columns"):
        file_task(_context(), **{**data, "eval_path": str(tmp_path / "bad.jsonl")})
    with pytest.raises(ValueError, match="does not exist"):
        file_task(_context(), **{**data, "eval_path": str(tmp_path / "missing.jsonl")})
    for bad in ({"every_versions": -1}, {"samples_per_prompt": 0}, {"temperature": "hot"}):
        with pytest.raises(ValueError):
            EvalConfig(**bad)


# --- scoring and bookkeeping -------------------------------------------------------------


@pytest.mark.unit
def test_a_version_row_says_what_each_reward_function_gave():
    from producers.engine.client import GenerateOutput

    def out(n: int, finish: str) -> GenerateOutput:
        return GenerateOutput("r", [3] * n, None, finish, {}, 2, "4", "")

    scores = [
        Score(1.0, {"rewards": {"a": 1.0, "b": None}, "reward_failed": True}),
        Score(3.0, {"rewards": {"a": 2.0, "b": 0.5}, "reward_failed": False}),
    ]
    row = summarize(4, scores, [out(2, "stop"), out(4, "length")], prompts=1)
    assert row["step"] == row["version"] == 4
    assert row["eval/reward/mean"] == 2.0 and row["eval/reward/std"] == 1.0
    assert row["eval/fn/a"] == 1.5 and row["eval/fn/b"] == 0.5  # over the values present
    assert row["eval/response_length/mean"] == 3.0 and row["eval/truncated_frac"] == 0.5
    assert row["eval/reward_failed_frac"] == 0.5
    assert "eval/reward/reward_failed_frac" not in row


@pytest.mark.unit
def test_a_version_row_gives_the_share_of_each_reward_flag():
    from producers.engine.client import GenerateOutput

    outs = [GenerateOutput("r", [3], None, "stop", {}, 2, "4", "")] * 4
    flags = [(True, True), (False, True), (False, False), (False, True)]
    scores = [Score(float(c), {"correct": c, "format_ok": f, "parsed": 3}) for c, f in flags]
    row = summarize(4, scores, outs, prompts=4)
    assert row["eval/reward/correct_frac"] == 0.25
    assert row["eval/reward/format_ok_frac"] == 0.75
    assert "eval/reward/parsed_frac" not in row


@pytest.mark.unit
def test_due_versions_keep_the_newest_multiple_not_yet_done(tmp_path):
    async def scenario() -> list:
        due = DueVersions(2, {2}, asyncio.get_running_loop(), asyncio.Event())
        for version in (1, 2, 3, 4, 6, 5):  # 2 is done, odd ones are not due, 6 beats 4
            due.submit_version(version, {"v": version})
        await asyncio.wait_for(due.arrived.wait(), 5)
        return [due.take(), due.take()]

    assert asyncio.run(scenario()) == [(6, {"v": 6}), None]
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 0, "version": 0}\n{"step": 4, "version": 4}\n{"step": 6, "ver')
    assert evaluated_versions(path) == {0, 4}  # a torn last line is not a version


@pytest.mark.unit
def test_report_puts_eval_rows_on_the_step_of_their_version(tmp_path):
    trainer = _write_rows(
        tmp_path / "t.jsonl", [{"step": s, "reward/mean": s / 10} for s in (1, 2)]
    )
    evals = _write_rows(
        tmp_path / "e.jsonl",
        [{"step": v, "version": v, "eval/reward/mean": v + 0.5} for v in (0, 2)],
    )
    metrics = load_metrics("run", [trainer], [evals])
    assert metrics.series("eval/reward/mean") == ([0.0, 2.0], [0.5, 2.5])
    assert metrics.series("reward/mean") == ([1.0, 2.0], [0.1, 0.2])


# --- on a real engine --------------------------------------------------------------------


def _every_second_version(data: dict) -> ProducersConfig:
    """The file task's eval split, two greedy samples a prompt, every second version."""
    return ProducersConfig(
        engine=EngineConfig(seed=0),
        rollout=RolloutConfig(
            progress=False,
            task="file",
            task_options=data,
            sampling=SamplingConfig(ignore_eos=True, stop_token_ids=[]),
        ),
        eval=EvalConfig(every_versions=2, samples_per_prompt=2),
    )


def _perturbed(version: int) -> dict:
    """Weights whose greedy completions differ from version to version (the tiny model's
    own initialisations all answer the same token)."""
    noise = torch.Generator().manual_seed(version)
    return {
        name: t + torch.randn(t.shape, generator=noise) * 0.5 if t.is_floating_point() else t
        for name, t in build_tiny_llama(seed=0).state_dict().items()
    }


def _expected_row(data: dict, rollout: RolloutConfig, state_dict: dict, version: int) -> dict:
    """What a fresh engine loaded with ``state_dict`` scores on the eval split, greedy."""

    async def measure() -> dict:
        backend = LocalBackend(engine_from_config(EngineConfig(seed=0), default_cache_dir()))
        try:
            task = file_task(_context(), **data)
            params = (
                RolloutConfig(progress=False)
                .sampling.model_copy(update={"temperature": 0.0})
                .to_sglang(task.max_new_tokens, task.stop_token_ids)
            )
            evaluator = Evaluator(backend, task, task.eval_prompts(), params, samples=2)
            return await evaluator.evaluate(version, state_dict)
        finally:
            await backend.aclose()

    return asyncio.run(measure())


@pytest.mark.unit
def test_an_engine_serving_another_version_is_refused(data):
    async def scenario() -> None:
        backend = LocalBackend(engine_from_config(EngineConfig(seed=0), default_cache_dir()))
        try:
            task = file_task(_context(), **data)
            params = {"temperature": 0.0, "max_new_tokens": 2}
            evaluator = Evaluator(backend, task, task.eval_prompts(), params, samples=1)
            await evaluator.evaluate(3, None)  # the engine serves v0
        finally:
            await backend.aclose()

    with pytest.raises(EvalError, match="evaluating v3"):
        asyncio.run(scenario())


@pytest.mark.integration
def test_every_second_version_is_measured_once_across_a_restart(
    kafka_config, s3_config, unique_name, tmp_path, data
):
    from schemas.topics import POLICY_VERSIONS
    from weights.announce import Announcer
    from weights.store import WeightStore
    from weights.writer import DeltaWriter

    client = kafka_config.client_config()
    versions_topic = unique_name("policy.versions")
    ensure_topics(client, [dataclasses.replace(POLICY_VERSIONS, name=versions_topic)])
    config = RollstreamConfig(
        run_id=f"eval-{uuid.uuid4().hex[:6]}",
        state_dir=tmp_path / "state",
        cache_dir=default_cache_dir(),
        kafka=kafka_config,
        s3=s3_config,
        weights=WeightsConfig(topic=versions_topic, poll_interval_s=0.5, allow_unsigned=True),
        tracking=TrackingConfig(backends=["tensorboard"]),
    )
    settings = _every_second_version(data)
    states = {v: _perturbed(v) for v in range(5)}
    announcer = Announcer(client, versions_topic)
    writer = DeltaWriter(WeightStore.from_config(s3_config, config.run_id), announcer=announcer)
    path = tmp_path / "state" / "eval" / config.run_id / "metrics.jsonl"

    def rows() -> list[dict]:
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def evaluate_while(publish: list[int], wait_for: list[int]) -> int:
        """Run the evaluator, publishing ``publish`` one at a time, each once the rows
        before it are written; stop once ``wait_for`` versions are in the file."""
        stop = threading.Event()

        def trainer() -> None:
            for version in publish:
                writer.publish(states[version], version)
                deadline = time.monotonic() + 120
                while version in wait_for and version not in evaluated_versions(path):
                    assert time.monotonic() < deadline, f"v{version} was not evaluated"
                    time.sleep(0.1)
            stop.set()

        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            return asyncio.run(asyncio.wait_for(run_evaluator(config, settings, stop), 240))
        finally:
            stop.set()
            thread.join(60)

    try:
        assert evaluate_while([0, 1, 2], wait_for=[0, 2]) == 2
        # restarted: v2 (the current version) is in the file already, v3 is not due
        assert evaluate_while([3, 4], wait_for=[4]) == 1
    finally:
        announcer.close()
    found = rows()
    assert [row["version"] for row in found] == [0, 2, 4]
    # the versions answer differently, so a row measured at the wrong one would show
    assert len({row["eval/fn/first_token"] for row in found}) == 3
    for row in found:
        expected = _expected_row(data, settings.rollout, states[row["version"]], row["version"])
        for key in ("eval/reward/mean", "eval/fn/first_token", "eval/fn/target_seen"):
            assert row[key] == expected[key], (row["version"], key)
        assert row["eval/prompts"] == 3 and row["eval/samples"] == 6
    # and in TensorBoard, at the version as its step, across the restart
    board = (
        tmp_path / "state" / "tracking" / config.run_id / "tensorboard" / f"{config.run_id}-eval"
    )
    scalars = tensorboard_scalars(board, "eval/reward/mean")
    assert [(s, pytest.approx(v)) for s, v in scalars] == [
        (row["version"], row["eval/reward/mean"]) for row in found
    ]


@pytest.mark.unit
def test_up_starts_an_evaluator_when_the_config_asks_for_one(tmp_path):
    from rollstream.config.settings import UpConfig, load_config
    from rollstream.up.plan import Ports, build_config, role_specs, write_config
    from rollstream.up.supervise import stop_order

    (tmp_path / "run.toml").write_text("[producers.eval]\nevery_versions = 5\n")
    base = load_config(tmp_path / "run.toml")
    run_dir = tmp_path / "run"
    config = build_config(base, UpConfig(), "ev", run_dir, Ports.free())
    assert config.producers.eval.metrics_file == run_dir / "eval.jsonl"
    path = run_dir / "rollstream.toml"
    write_config(config, path)
    specs = {spec.name: spec.argv for spec in role_specs(path, config, None)}
    assert specs["eval"][-1] == "eval"
    assert stop_order(sorted(specs))[0] == "eval"  # it stops before the producers
    assert load_config(path).producers.eval.every_versions == 5
    (tmp_path / "off.toml").write_text("")
    off = build_config(load_config(tmp_path / "off.toml"), UpConfig(), "ev", run_dir, Ports.free())
    assert "eval" not in {spec.name for spec in role_specs(path, off, None)}


@pytest.mark.unit
def test_the_eval_command_refuses_what_it_cannot_evaluate(tmp_path):
    from click.testing import CliRunner

    from rollstream.cli.main import main

    config = tmp_path / "run.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n')
    off = CliRunner().invoke(main, ["--config", str(config), "eval"])
    assert off.exit_code == 2 and "every_versions" in off.output
    garbage = CliRunner().invoke(main, ["--config", str(config), "eval", "--every-versions", "-3"])
    assert garbage.exit_code == 2 and "greater than or equal to 0" in garbage.output


# --- the versions a store already holds (a finished run, a fork) --------------------------


@pytest.mark.unit
def test_stored_versions_due_are_the_multiples_or_the_ones_named():
    from producers.evaluation import stored_due

    stored = [0, 1, 2, 3, 4, 5, 6]
    assert stored_due(stored, 2, {2}, None) == [0, 4, 6]  # 2 is in the file already
    assert stored_due(stored, 0, set(), [5, 1]) == [1, 5]
    assert stored_due(stored, 3, {1}, [1]) == []
    with pytest.raises(ValueError, match=r"holds no version \[9\]"):
        stored_due(stored, 2, set(), [4, 9])
    assert stored_due(stored, 0, {2}, None) == [0, 1, 3, 4, 5, 6]  # no schedule: every one


@pytest.mark.unit
def test_the_digit_tasks_have_a_fixed_eval_set_of_distinct_prompts():
    from producers.tasks.catalog import make_task

    task = make_task("reverse-3-digits", {}, _context())
    first, again = task.eval_prompts(), make_task("reverse-3-digits", {}, _context()).eval_prompts()
    assert [p.ids for p in first] == [p.ids for p in again]  # the same in every process
    assert len(first) == 32 and len({tuple(p.ids) for p in first}) == 32
    assert all(p.meta["target"] == p.meta["digits"][::-1] for p in first)
    assert len(make_task("repeat-digit", {"eval_size": 50}, _context()).eval_prompts()) == 10
    for bad in (0, -1, "8", True, 2.5):
        with pytest.raises(ValueError, match="eval_size"):
            make_task("reverse-3-digits", {"eval_size": bad}, _context())


@pytest.mark.unit
def test_the_eval_command_refuses_garbage_stored_options(tmp_path):
    from click.testing import CliRunner

    from rollstream.cli.main import main

    config = tmp_path / "run.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n')
    for args, message in (
        (["--run", "other"], "go with --stored"),
        (["--stored", "--versions", "1,x"], "not a comma-separated list"),
        (["--stored", "--versions", "3,-1"], "0 or more"),
        (["--every-versions", "0"], "every_versions"),  # --stored alone: every stored version
    ):
        done = CliRunner().invoke(main, ["--config", str(config), "eval", *args])
        assert done.exit_code == 2 and message in done.output, (args, done.output)
    assert not (tmp_path / "eval").exists()


@pytest.mark.integration
def test_the_versions_a_store_holds_are_measured_once_and_the_command_ends(
    s3_config, tmp_path, data
):
    from producers.evaluation import evaluate_stored
    from weights.store import WeightStore
    from weights.writer import DeltaWriter

    config = RollstreamConfig(
        run_id=f"stored-{uuid.uuid4().hex[:6]}",
        state_dir=tmp_path / "state",
        cache_dir=default_cache_dir(),
        s3=s3_config,
        weights=WeightsConfig(allow_unsigned=True),
    )
    settings = _every_second_version(data)
    states = {v: _perturbed(v) for v in range(5)}
    writer = DeltaWriter(WeightStore.from_config(s3_config, config.run_id))
    for version, state in states.items():  # published, never announced: a fork's lineage
        writer.publish(state, version)
    path = tmp_path / "state" / "eval" / config.run_id / "metrics.jsonl"

    assert asyncio.run(evaluate_stored(config, settings)) == 3
    assert asyncio.run(evaluate_stored(config, settings)) == 0  # all in the file already
    assert asyncio.run(evaluate_stored(config, settings, versions=[3, 4])) == 1
    with pytest.raises(ValueError, match="holds no version"):
        asyncio.run(evaluate_stored(config, settings, versions=[7]))
    found = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["version"] for row in found] == [0, 2, 4, 3]
    for row in found:  # each measured at its own version (deltas applied, verified)
        expected = _expected_row(data, settings.rollout, states[row["version"]], row["version"])
        for key in ("eval/reward/mean", "eval/fn/first_token", "eval/fn/target_seen"):
            assert row[key] == expected[key], (row["version"], key)

    # `eval --stored` with no every_versions in the config: every stored version (1 is left)
    from click.testing import CliRunner

    from core.config import to_toml
    from rollstream.cli.main import main

    unscheduled = settings.model_copy(update={"eval": EvalConfig(samples_per_prompt=2)})
    file = tmp_path / "rollstream.toml"
    file.write_text(
        to_toml(
            {
                "run_id": config.run_id,
                "state_dir": str(config.state_dir),
                "cache_dir": str(config.cache_dir),
                "s3": s3_config.file_table(),
                "weights": {"allow_unsigned": True},
                "producers": unscheduled.model_dump(mode="json", exclude_defaults=True),
            }
        )
    )
    done = CliRunner().invoke(main, ["--config", str(file), "eval", "--stored"])
    assert done.exit_code == 0 and "evaluated 1 version(s)" in done.output, done.output
    assert [json.loads(line)["version"] for line in path.read_text().splitlines()][4:] == [1]
