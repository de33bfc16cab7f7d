"""Tasks and rewards on hand-made cases; the registry; user prompt files; the config."""

from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.models import BOS_ID, DIGIT0_ID, EOS_ID, SEP_ID, TinyTokenizer
from producers.config import ProducersConfig, RolloutConfig, SamplingConfig
from producers.tasks.base import (
    TaskContext,
    make_word_problem,
    register_task,
    score_arithmetic,
    score_digits,
)
from producers.tasks.catalog import available_tasks, make_task
from rollstream.config.settings import load_config

TOK = TinyTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


@pytest.fixture()
def context(tmp_path: Path) -> TaskContext:
    return TaskContext(cache_dir=tmp_path)


def test_tiny_tokenizer_round_trip():
    assert ids("<bos>123<sep>") == [BOS_ID, DIGIT0_ID + 1, DIGIT0_ID + 2, DIGIT0_ID + 3, SEP_ID]
    assert TOK.decode(ids("<bos>4+5<sep>97<eos>")) == "<bos>4+5<sep>97<eos>"
    assert TOK.decode(ids("<bos>4+5<sep>97<eos>"), skip_special_tokens=True) == "4+597"
    assert TOK.decode([15]) == "<15>"  # the model's unnamed 16th id
    with pytest.raises(ValueError, match="not in the tiny vocabulary"):
        TOK.encode("12a")


@pytest.mark.parametrize(
    ("response", "reward", "correct", "answer", "format_ok"),
    [
        ("77<eos>", 1.0, True, "77", True),
        ("77", 2 / 3, False, "77", False),  # right digits, never stopped
        ("7<eos>", 1 / 3, False, "7", True),
        ("72<eos>", 2 / 3, False, "72", True),
        ("<eos>", 0.0, False, "", True),
        ("777<eos>", 2 / 3, False, "777", True),
        ("+77<eos>", 1 / 3, False, "77", False),  # position-wise: only the middle 7
    ],
)
def test_digit_reward_gives_partial_credit(response, reward, correct, answer, format_ok):
    value, details = score_digits([7, 7], ids(response))
    assert value == pytest.approx(reward)
    assert details["correct"] is correct
    assert details["answer"] == answer
    assert details["format_ok"] is format_ok
    assert details["target"] == "77"
    json.dumps(details)  # travels in reward_details


def test_copy_and_reverse_tasks(context):
    assert {"copy-first-digit-twice", "reverse-3-digits", "arithmetic", "file"} <= set(
        available_tasks()
    )
    copy = make_task("copy-first-digit-twice", {}, context)
    prompt = copy.sample(random.Random(3))
    d = prompt.meta["digits"]
    assert prompt.ids == [BOS_ID, *(DIGIT0_ID + x for x in d), SEP_ID]
    assert copy.stop_token_ids == [EOS_ID]
    good = [DIGIT0_ID + d[0], DIGIT0_ID + d[0], EOS_ID]
    assert copy.reward(prompt, good) == (1.0, pytest.approx(copy.reward(prompt, good)[1]))
    reverse = make_task("reverse-3-digits", {"max_new_tokens": 5}, context)
    prompt = reverse.sample(random.Random(4))
    answer = [DIGIT0_ID + x for x in reversed(prompt.meta["digits"])] + [EOS_ID]
    assert reverse.reward(prompt, answer)[0] == 1.0
    assert reverse.max_new_tokens == 5
    # Same seed, same prompts.
    assert copy.sample(random.Random(9)) == copy.sample(random.Random(9))


@pytest.mark.parametrize("level", ["easy", "mixed", "two-step"])
def test_word_problems_are_seeded_and_integer(level):
    first = [make_word_problem(random.Random(11), level) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    rng = random.Random(0)
    problems = [make_word_problem(rng, level) for _ in range(200)]
    assert len({q for q, _ in problems}) > 150
    assert all(isinstance(a, int) and a >= 0 for _, a in problems)
    question, _ = make_word_problem(random.Random(5), level)
    assert question.endswith("?")


def test_easy_word_problems_are_one_small_addition_or_subtraction():
    rng = random.Random(3)
    for _ in range(200):
        question, answer = make_word_problem(rng, "easy")
        a, b = (int(n) for n in re.findall(r"\d+", question))
        assert answer == (a + b if "more" in question else a - b)
        assert 0 < answer <= 21 and b <= 9


def test_two_step_word_problems_add_and_subtract():
    rng = random.Random(4)
    for _ in range(300):
        question, answer = make_word_problem(rng, "two-step")
        a, first, second = (int(n) for n in re.findall(r"\d+", question))
        if "gets" in question.split(",")[0]:  # gets first, then gives away
            assert answer == a + first - second
        else:
            assert answer == a - first + second and a - first >= 0
        assert 0 < answer <= 24 and max(a, first, second) <= 24


def test_the_eval_split_is_fixed_and_held_out_of_training(context):
    options = {"level": "two-step", "eval_size": 40}
    task = make_task("arithmetic", options, TaskContext(context.cache_dir, _ChatTokenizer()))
    again = make_task("arithmetic", options, TaskContext(context.cache_dir, _ChatTokenizer()))
    held_out = task.eval_prompts()
    assert len(held_out) == 40 and [p.text for p in held_out] == [
        p.text for p in again.eval_prompts()
    ]
    numbers = {tuple(re.findall(r"\d+", p.text)) for p in held_out}
    rng = random.Random(0)
    trained = [task.sample(rng) for _ in range(2000)]
    assert not numbers & {tuple(re.findall(r"\d+", p.text)) for p in trained}
    # the two-step level shows a worked example with both operations
    assert len(trained[0].ids) == 6
    without = make_task("arithmetic", {}, TaskContext(context.cache_dir, _ChatTokenizer()))
    with pytest.raises(ValueError, match="no eval split"):
        without.eval_prompts()


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("3 + 4 = 7\nAnswer: 7", 1.0),  # right, in the format
        ("So she has 7 now.", 0.8),  # right, no answer line
        ("Answer: 8", 0.2),  # the format only
        ("I think eight", 0.0),
    ],
)
def test_the_format_reward_is_a_share_of_the_reward(text, reward):
    value, _ = score_arithmetic(text, 7, format_reward=0.2)
    assert value == pytest.approx(reward)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"level": "hard"}, "unknown arithmetic level"),
        ({"level": None}, "unknown arithmetic level"),
        ({"format_reward": 1.5}, "format_reward must be within"),
        ({"format_reward": -0.1}, "format_reward must be within"),
        ({"format_reward": "0.1"}, "format_reward must be a number"),
        ({"level": "two_step"}, "unknown arithmetic level"),
        ({"eval_size": -1}, "eval_size must be within"),
        ({"eval_size": 10**6}, "eval_size must be within"),
        ({"eval_size": "64"}, "eval_size must be an integer"),
        ({"eval_size": 6.5}, "eval_size must be an integer"),
        ({"eval_size": True}, "eval_size must be an integer"),
        ({"difficulty": "easy"}, "difficulty"),
    ],
)
def test_bad_arithmetic_options_are_refused_with_a_clear_error(context, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_task("arithmetic", options, TaskContext(context.cache_dir, _ChatTokenizer()))


@pytest.mark.parametrize(
    ("text", "reward", "parsed", "format_ok"),
    [
        ("12 + 7 = 19.\nAnswer: 19", 1.0, 19, True),
        ("Answer: 1,200", 0.0, 1200, True),
        ("answer = 19", 1.0, 19, True),
        ("First 10, then 19", 1.0, 19, False),  # last number, format not followed
        ("Answer: 18\nWait, Answer: 19", 1.0, 19, True),  # the last answer line counts
        ("I don't know", 0.0, None, False),
        ("Answer: -19", 0.0, -19, True),
    ],
)
def test_arithmetic_reward_checks_the_exact_answer(text, reward, parsed, format_ok):
    value, details = score_arithmetic(text, 19 if "1,200" not in text else 1201)
    assert value == reward
    assert details["parsed"] == parsed
    assert details["format_ok"] is format_ok
    assert details["correct"] is (reward == 1.0)


class _ChatTokenizer:
    """Just enough of a Hugging Face tokenizer for the arithmetic task's plumbing."""

    eos_token_id = 2
    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return 3 if token == "<|im_end|>" else self.unk_token_id

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": [1, *(len(m["content"]) % 50 for m in messages), 4]}

    def decode(self, ids, skip_special_tokens=True):
        return "Answer: " + "".join(str(i) for i in ids)


def test_arithmetic_task_with_a_tokenizer(context):
    task = make_task("arithmetic", {}, TaskContext(context.cache_dir, _ChatTokenizer()))
    assert task.stop_token_ids == [2, 3]
    prompt = task.sample(random.Random(1))
    assert prompt.ids[0] == 1 and prompt.text.endswith("?")
    # system, the worked example (question and answer), the question
    assert len(prompt.ids) == 6
    bare = make_task(
        "arithmetic", {"one_shot": False}, TaskContext(context.cache_dir, _ChatTokenizer())
    )
    assert len(bare.sample(random.Random(1)).ids) == 4
    answer = prompt.meta["answer"]
    reward, details = task.reward(prompt, [int(c) for c in str(answer)])
    assert reward == 1.0 and details == {
        "parsed": answer,
        "answer": answer,
        "correct": True,
        "format_ok": True,
    }


def _write_reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def ends_with_target(text, ids, example):
                ok = text.endswith(example["target"])
                return float(ok), {"target": example["target"], "correct": ok}

            def plain(text, ids, example):
                return len(ids) / 10

            def not_a_task(context):
                return object()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_file_task_from_jsonl_and_parquet(tmp_path, monkeypatch, context):
    module = _write_reward_module(tmp_path, monkeypatch)
    rows = [
        {"prompt": "<bos>12<sep>", "target": "21"},
        {"prompt": "<bos>34<sep>", "target": "43"},
    ]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = make_task(
        "file",
        {"path": str(jsonl), "reward": f"{module}:ends_with_target", "tokenizer": "tiny"},
        context,
    )
    prompt = task.sample(random.Random(0))
    example = rows[prompt.meta["index"]]
    assert prompt.ids == ids(example["prompt"])
    assert task.stop_token_ids == [EOS_ID]
    reward, details = task.reward(prompt, ids(example["target"] + "<eos>"))
    assert reward == 1.0
    assert details == {
        "target": example["target"],
        "correct": True,
        "example_index": prompt.meta["index"],
    }
    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt_ids": [1, 5, 3]}]), parquet)
    task = make_task(
        "file",
        {"path": str(parquet), "reward": f"{module}.plain", "name": "mine", "max_new_tokens": 4},
        context,
    )
    prompt = task.sample(random.Random(0))
    assert (task.name, task.max_new_tokens, prompt.ids) == ("mine", 4, [1, 5, 3])
    assert task.reward(prompt, [5, 6]) == (0.2, {"example_index": 0})


def test_registry_errors_and_extension(context, tmp_path, monkeypatch):
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        make_task("nope", {}, context)
    module = _write_reward_module(tmp_path, monkeypatch)
    prompts = tmp_path / "x.jsonl"
    prompts.write_text('{"prompt_ids": [1, 3]}\nnot json\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not JSON"):
        make_task("file", {"path": str(prompts), "reward": f"{module}:plain"}, context)
    prompts.write_text('{"prompt_ids": [1, 3]}\n')
    with pytest.raises(ValueError, match="has no attribute"):
        make_task("file", {"path": str(prompts), "reward": f"{module}:x"}, context)

    @register_task("test-constant")
    def constant(context, value=1):
        task = make_task("copy-first-digit-twice", {}, context)
        task.name = "test-constant"
        return task

    assert make_task("test-constant", {}, context).name == "test-constant"
    with pytest.raises(ValueError, match="already registered"):
        register_task("test-constant")(lambda context: None)
    with pytest.raises(TypeError, match="has no"):
        make_task(f"{module}:not_a_task", {}, context)


def test_producers_config_rejects_unknown_keys_and_parses_toml(tmp_path):
    assert ProducersConfig().rollout.version_policy == "interrupt"
    with pytest.raises(ValueError, match="extra"):
        RolloutConfig(bogus=1)
    with pytest.raises(ValueError, match="max_inflight_groups"):
        RolloutConfig(max_inflight_groups=10, max_undelivered_groups=5)
    with pytest.raises(ValueError):
        RolloutConfig(version_policy="later")
    path = tmp_path / "rollstream.toml"
    path.write_text(
        textwrap.dedent(
            """
            [producers.engine]
            model = "tiny"
            port = 0
            [producers.rollout]
            group_size = 4
            version_policy = "abort"
            [producers.rollout.sampling]
            temperature = 0.8
            """
        )
    )
    config = load_config(path).producers
    assert (config.rollout.group_size, config.rollout.sampling.temperature) == (4, 0.8)
    assert config.rollout.version_policy == "abort"
    params = SamplingConfig(top_k=5).to_sglang(max_new_tokens=8, stop_token_ids=[2])
    assert params == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "min_p": 0.0,
        "max_new_tokens": 8,
        "stop_token_ids": [2],
        "ignore_eos": False,
    }


def test_repeat_digit_has_a_long_tail_of_answer_lengths(context):
    task = make_task("repeat-digit", {}, context)
    rng = random.Random(0)
    lengths = set()
    for _ in range(200):
        prompt = task.sample(rng)
        (d,) = prompt.meta["digits"]
        answer = [DIGIT0_ID + d] * (2 * d + 1) + [EOS_ID]
        assert task.reward(prompt, answer)[0] == 1.0
        assert task.reward(prompt, [*answer[:-2], EOS_ID])[0] < 1.0 or d == 0
        lengths.add(len(answer))
    assert min(lengths) == 2 and max(lengths) == 20 and task.max_new_tokens >= 20
