"""``rollstream init``: the starter run is a valid run of one's own (its config loads and
its task options pass the checks ``up`` makes), its rewards score content far above
format, and it never writes over anything. And ``rollstream.config.run_files``: a run ``up``
made is found by its id. The starter's commands run end to end in
tests/system/rollstream/test_first_try.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rollstream.cli.main import main
from rollstream.cli.starter import write_starter
from rollstream.config.run_files import RUN_CONFIG, default_run_dir, run_config, run_sources
from rollstream.config.settings import ConfigSources, load_config
from rollstream.up.plan import check_tasks

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def starter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("starter") / "my-grpo"
    write_starter(directory)
    return directory


def test_the_starter_config_is_a_run_of_ones_own(
    starter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(starter)  # relative paths are relative to where `up` starts
    config = load_config(Path("rollstream.toml"))
    assert config.run_id == "my-grpo"
    rollout = config.producers.rollout
    assert rollout.task == "file" and config.profile.model == "./models/my-model"
    check_tasks(config)  # what `up` checks before anything starts
    for key in ("path", "eval_path"):
        text = Path(rollout.task_options[key]).read_text()
        rows = [json.loads(line) for line in text.splitlines()]
        assert rows and all(r["messages"][0]["role"] == "user" for r in rows)
        assert all(r["answer"] == r["messages"][0]["content"][0] * 2 for r in rows)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("models/my-model")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "123"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user 123<|im_end|><|im_start|>assistant "
    model = AutoModelForCausalLM.from_pretrained("models/my-model")
    assert model.config.vocab_size == len(tokenizer)


def test_the_starter_rewards_pay_content_not_format(starter: Path) -> None:
    spec = importlib.util.spec_from_file_location("my_rewards", starter / "my_rewards.py")
    assert spec is not None and spec.loader is not None
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)

    def total(answer: str, target: str) -> float:
        completion = [[{"role": "assistant", "content": answer}]]
        return (
            rewards.accuracy_reward(completion, answer=[target])[0]
            + rewards.format_reward(completion)[0]
        )

    best = total("33", "33")
    assert best == pytest.approx(1.1)
    assert total("77", "33") / best <= 0.1  # a right format alone: under a tenth
    assert total("3x", "33") == pytest.approx(0.5)  # half the content, no format
    assert total("", "33") == 0.0


def test_init_writes_nothing_over_what_is_there(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for target in (taken, a_file):
        result = CliRunner().invoke(main, ["init", str(target)])
        assert result.exit_code == 1
        assert "exists and is not empty" in result.output and "Traceback" not in result.output
    assert (taken / "notes.txt").read_text() == "mine" and sorted(taken.iterdir()) == [
        taken / "notes.txt"
    ]
    assert a_file.read_text() == "mine"
    garbage = CliRunner().invoke(main, ["init", str(tmp_path / "new"), "--seed", "many"])
    assert garbage.exit_code == 2 and "many" in garbage.output
    assert not (tmp_path / "new").exists()


def test_a_run_up_made_is_found_by_its_id(tmp_path: Path) -> None:
    state = tmp_path / "state"
    users = tmp_path / "users.toml"
    users.write_text('run_id = "mine"\n')
    sources = ConfigSources(users, {"state_dir": str(state)})
    config = sources.resolve()
    assert run_sources(sources, config, "demo") is sources  # no run `demo` here
    run_dir = default_run_dir(state, "demo")
    run_dir.mkdir(parents=True)
    (run_dir / RUN_CONFIG).write_text('run_id = "demo"\n[trainer.engine]\nlr = 0.5\n')
    found = run_sources(sources, config, "demo")
    assert found.path == (run_dir / RUN_CONFIG).resolve()
    assert found.overrides["state_dir"] == str(state)
    assert found.resolve().trainer.engine.lr == 0.5
    assert run_config(config, "demo").run_id == "demo"
    assert run_sources(found, config, "demo") is found  # given the run's own file
    with_set = ConfigSources(users, {"state_dir": str(state), "trainer": {"engine": {"lr": 0.25}}})
    assert run_sources(with_set, config, "demo").resolve().trainer.engine.lr == 0.25
