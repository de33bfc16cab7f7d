"""TRL-style reward functions and the file task's data sources, on hand-made cases.

A reward module and data files are written on the fly; the chat tokenizer is the tiny
vocabulary as a real ``PreTrainedTokenizerFast`` with a chat template. The records the
producer builds are validated and encoded as they would be published.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pytest
from prometheus_client import CollectorRegistry

from consumers.metrics import data_metrics
from core.model_files import tiny_tokenizer
from core.models import TinyTokenizer
from producers.rollout.generation import Sample
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.publishing import ProducerIdentity, RecordBuilder
from producers.tasks.base import TaskContext
from producers.tasks.catalog import make_task
from producers.tasks.file import FileTask, read_examples
from producers.tasks.math_reward import math_accuracy
from producers.tasks.rewards import RewardSet
from schemas.codec import decode, encode

pytestmark = pytest.mark.unit

TOK = TinyTokenizer()
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}+{% endif %}{{ m['content'] }}"
    "<sep>{% endfor %}{% if double %}++{% endif %}{% if add_generation_prompt %}<bos>{% endif %}"
)

REWARD_MODULE = '''
import asyncio, math, time

def length(completions, completion_ids, **kwargs):
    """TRL style: one float per completion."""
    return [float(len(ids)) for ids in completion_ids]

async def matches(prompts, completions, target, **kwargs):
    await asyncio.sleep(0)
    return [1.0 if c == t else (None if c == "" else 0.0) for c, t in zip(completions, target)]

def picky(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    if any("9" in text for text in texts):
        raise ValueError("no nines")
    return [0.5] * len(completions)

def sleepy(completions, **kwargs):
    time.sleep(1)
    return [1.0] * len(completions)

async def async_sleepy(completions, **kwargs):
    await asyncio.sleep(5)
    return [1.0] * len(completions)

def a_string(completions, **kwargs):
    return "1.0"

def too_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def odd_values(completions, **kwargs):
    return [math.nan, True, "2", 3, math.inf][: len(completions)]

def echo_kwargs(prompts, completions, completion_ids, **kwargs):
    echo_kwargs.seen = dict(prompts=prompts, completions=completions, **kwargs)
    return [0.0] * len(completions)

not_callable = 3
'''


@pytest.fixture()
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def rewards(module: str, *entries: tuple[str, float] | dict) -> RewardSet:
    configs = [
        e if isinstance(e, dict) else {"function": f"{module}:{e[0]}", "weight": e[1]}
        for e in entries
    ]
    return RewardSet.from_configs(configs)


def score(reward_set: RewardSet, completions: list[str], **columns):
    ids = [TOK.encode(c) for c in completions]
    n = len(completions)
    return asyncio.run(
        reward_set.score(["12"] * n, completions, ids, {k: [v] * n for k, v in columns.items()})
    )


def test_weighted_sync_and_async_functions_with_columns(module: str) -> None:
    scores = score(rewards(module, ("length", 0.5), ("matches", 2.0)), ["21", "3", ""], target="21")
    assert [s.reward for s in scores] == [0.5 * 2 + 2.0, 0.5 * 1 + 0.0, 0.0]
    assert scores[0].details == {"rewards": {"length": 2.0, "matches": 1.0}, "reward_failed": False}
    # None: the function does not apply; it adds nothing and is not an error
    assert scores[2].details["rewards"] == {"length": 0.0, "matches": None}
    assert not scores[2].details["reward_failed"]


def test_what_goes_wrong_inside_a_function_is_contained(module: str) -> None:
    set_ = RewardSet.from_configs(
        [
            {"function": f"{module}:length"},
            {"function": f"{module}:picky"},
            {"function": f"{module}:sleepy", "timeout_s": 0.2},
            {"function": f"{module}:async_sleepy", "timeout_s": 0.2},
            {"function": f"{module}:a_string"},
            {"function": f"{module}:too_short"},
            {"function": f"{module}:odd_values"},
        ]
    )
    scores = score(set_, ["12", "9", "3", "4", "5"])
    first, errors = scores[0], scores[0].details["reward_errors"]
    assert first.details["reward_failed"] is True
    assert errors["picky"] == "raised ValueError: no nines"
    assert errors["sleepy"] == errors["async_sleepy"] == "timed out after 0.2s"
    assert errors["a_string"] == "returned str, not a list of 5 numbers or None"
    assert errors["too_short"] == "returned 4 values for 5 completions"
    assert errors["odd_values"] == "value nan is not finite"
    odd = [s.details["reward_errors"].get("odd_values") for s in scores]
    assert odd == [
        "value nan is not finite",
        "value True is not a number or None",
        "value '2' is not a number or None",
        None,
        "value inf is not finite",
    ]
    # the functions that worked still count
    assert [s.reward for s in scores] == [2.0, 1.0, 1.0, 1.0 + 3.0, 1.0]
    assert scores[3].details["rewards"]["odd_values"] == 3.0
    json.dumps([s.details for s in scores])  # travels in reward_details


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ("x:y", "is a list"),
        ({"function": "x:y"}, "is a list"),
        ([], "at least one function"),
        ([{"weight": 1.0}], r"rewards\[0\].*function"),
        ([{"function": "{m}:length", "weight": "heavy"}], r"rewards\[0\].*weight"),
        ([{"function": "{m}:length", "weight": math.nan}], r"rewards\[0\].*weight"),
        ([{"function": "{m}:length", "timeout_s": 0}], r"rewards\[0\].*timeout_s"),
        ([{"function": "{m}:length", "colour": "red"}], r"rewards\[0\].*colour"),
        ([{"function": "{m}:missing"}], r"rewards\[0\].*has no attribute"),
        ([{"function": "no_such_module_x:f"}], r"rewards\[0\].*No module named"),
        ([{"function": "{m}:not_callable"}], "is not callable"),
        ([{"function": "{m}:length"}, {"function": "{m}:length"}], "names must differ"),
        ([{"function": "{m}:length", "name": "a b"}], r"rewards\[0\].*name"),
    ],
)
def test_bad_reward_configs_are_clear_errors(module: str, configs, message: str) -> None:
    configs = json.loads(json.dumps(configs).replace("{m}", module))
    with pytest.raises(ValueError, match=message):
        RewardSet.from_configs(configs)


def test_math_accuracy_compares_answers_not_strings() -> None:
    completions = [
        "so the answer is \\boxed{\\frac{1}{2}}",
        "I think it is 0.5",
        [{"role": "assistant", "content": "$x = 3$"}],
        "42",
        "anything",
    ]
    solutions = ["0.5", "$\\frac{1}{2}$", "3", "41", "no answer here"]
    assert math_accuracy(completions, solutions) == [1.0, 1.0, 1.0, 0.0, None]


# --- data sources ---------------------------------------------------------------------------


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_rows_from_csv_a_saved_dataset_and_a_column_mapping(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    rows = [{"question": "12", "answer": "21"}, {"question": "34", "answer": "43"}]
    numbers = [{k: int(v) for k, v in row.items()} for row in rows]
    pcsv.write_csv(pa.Table.from_pylist(numbers), tmp_path / "p.csv")
    assert read_examples(tmp_path / "p.csv") == rows  # cells as text, not inferred numbers
    splits = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])})
    splits.save_to_disk(str(tmp_path / "ds"))
    assert read_examples(tmp_path / "ds", "test") == rows[:1]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert read_examples(tmp_path / "one") == rows

    context = TaskContext(cache_dir=tmp_path, tokenizer=chat_tokenizer())
    options = {
        "path": str(tmp_path / "ds"),
        "split": "train",
        "columns": {"prompt": "question"},
        "rewards": [{"function": "producers.tasks.math_reward:math_accuracy"}],
    }
    task = make_task("file", options, context)
    prompt = task.sample(random.Random(1))
    assert prompt.text == rows[prompt.meta["index"]]["question"]
    assert prompt.ids == TOK.encode(prompt.text)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "{tmp}/missing.jsonl"}, "does not exist"),
        ({"path": "{tmp}/p.txt"}, "unknown format"),
        ({"path": "{tmp}/bad.parquet"}, "cannot read"),
        ({"path": "{tmp}/ds"}, r"splits \['test', 'train'\]: choose one"),
        ({"path": "{tmp}/ds", "split": "dev"}, "'dev' is not one"),
        ({"columns": {"prompt": "query"}}, r"'query' is not a column .*\['answer', 'question'\]"),
        ({"columns": {"answer": "question"}}, "'answer' is not a name the file task reads"),
        ({"columns": {}}, "has none of the columns"),
        ({"rewards": None, "reward": None}, "needs 'rewards'"),
        ({"reward": "x:y"}, "either 'rewards'"),
        ({"path": "{tmp}/rows.jsonl"}, r"rows\.jsonl:1: a row is a JSON object"),
    ],
)
def test_bad_data_sources_are_clear_errors(tmp_path: Path, change: dict, message: str) -> None:
    from datasets import Dataset, DatasetDict

    rows = [{"question": "12", "answer": "21"}]
    (tmp_path / "p.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (tmp_path / "p.txt").write_text("12\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "rows.jsonl").write_text("[1, 2]\n")
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "ds")
    )
    options = {
        "path": str(tmp_path / "p.jsonl"),
        "columns": {"prompt": "question"},
        "rewards": [{"function": "producers.tasks.math_reward:math_accuracy"}],
        "tokenizer": "tiny",
    }
    options.update(json.loads(json.dumps(change).replace("{tmp}", str(tmp_path))))
    options = {k: v for k, v in options.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        make_task("file", options, TaskContext(cache_dir=tmp_path))


def conversation_task(tmp_path: Path, module: str, **options) -> FileTask:
    rows = [
        {
            "messages": [{"role": "user", "content": "12"}, {"role": "assistant", "content": "3"}],
            "target": "21",
        },
        {"prompt": [{"role": "user", "content": "45"}], "target": "54"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = make_task(
        "file",
        {
            "path": str(path),
            "rewards": [
                {"function": f"{module}:echo_kwargs", "name": "echo"},
                {"function": f"{module}:picky", "weight": 2.0},
            ],
            **options,
        },
        TaskContext(cache_dir=tmp_path, tokenizer=chat_tokenizer()),
    )
    assert isinstance(task, FileTask)
    return task


def test_conversations_render_with_the_chat_template(tmp_path: Path, module: str) -> None:
    task = conversation_task(
        tmp_path, module, system_prompt="7", chat_template_kwargs={"double": True}
    )
    rendered = {}
    for seed in range(20):
        prompt = task.sample(random.Random(seed))
        rendered[prompt.meta["index"]] = prompt.ids
    # multi-turn history kept, the system prompt put first, the template's kwargs applied
    assert rendered[0] == TOK.encode("+7<sep>12<sep>3<sep>++<bos>")
    assert rendered[1] == TOK.encode("+7<sep>45<sep>++<bos>")
    with pytest.raises(ValueError, match="messages must be a list of"):
        task.render(0, {"messages": [{"role": "user"}]})
    plain = tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        make_task(
            "file",
            {"path": str(tmp_path / "chat.jsonl"), "reward": f"{module}:length"},
            TaskContext(cache_dir=tmp_path, tokenizer=plain),
        )


def test_group_records_carry_each_function_and_the_step_reports_them(
    tmp_path: Path, module: str
) -> None:
    task = conversation_task(tmp_path, module)
    metrics = ProducerMetrics(CollectorRegistry())
    builder = RecordBuilder(ProducerIdentity("run", "p0", "local"), task, metrics)
    prompt = next(
        p for p in (task.sample(random.Random(s)) for s in range(20)) if p.meta["index"] == 1
    )
    responses = ["21", "9"]
    samples = [Sample(TOK.encode(r), [-0.5] * len(r), [(0, len(r))], "stop", 0) for r in responses]
    records = asyncio.run(builder.group_trajectories(prompt, "g1", samples, 0))
    # what the reward functions were called with: TRL's arguments and the row's columns
    seen = __import__(module).echo_kwargs.seen
    assert seen["prompts"] == [[{"role": "user", "content": "45"}]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": r}] for r in responses]
    assert seen["target"] == ["54", "54"]
    for record in records:  # picky raised on the group's "9": no value for either sample
        assert decode(encode(record)).reward_details == record.reward_details
        assert record.reward == 0.0
        assert record.reward_details["rewards"] == {"echo": 0.0, "picky": None}
        assert record.reward_details["reward_errors"] == {"picky": "raised ValueError: no nines"}
        assert record.reward_details["example_index"] == 1
    errors = metrics.registry.get_sample_value(
        "rollstream_producer_reward_errors_total", {"function": "picky"}
    )
    assert errors == 2.0
    step = data_metrics(records, version=1)
    assert step["reward/reward_failed_frac"] == 1.0
    assert step["reward/fn/echo"] == 0.0 and "reward/fn/picky" not in step
    assert step["reward/fn_failed/picky"] == 1.0 and step["reward/fn_failed/echo"] == 0.0


def test_epochs_walk_every_row_once_and_resume_gives_back_what_was_not_delivered(
    tmp_path: Path,
) -> None:
    rows = [{"prompt_ids": [1, 5 + i, 3]} for i in range(5)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    options = {"path": str(path), "reward": "producers.tasks.math_reward:completion_text"}

    def walk(task: FileTask, n: int) -> list[tuple[int, int]]:
        prompts = [task.sample(random.Random(0)) for _ in range(n)]
        return [(p.meta["position"], p.meta["index"]) for p in prompts]

    context = TaskContext(cache_dir=tmp_path)
    task = make_task("file", {**options, "order": "epochs", "shuffle_seed": 3}, context)
    first = walk(task, 12)
    assert [pos for pos, _ in first] == list(range(12))
    for epoch in (0, 1):  # each epoch is every row once, in its own order
        assert sorted(i for _, i in first[5 * epoch : 5 * epoch + 5]) == list(range(5))
    assert [i for _, i in first[:5]] != [i for _, i in first[5:10]]

    again = make_task("file", {**options, "order": "epochs", "shuffle_seed": 3}, context)
    again.resume({0, 1, 3, 4, 6})  # 2 and 5 were in flight at a crash
    assert walk(again, 4) == [first[2], first[5], first[7], first[8]]
    with pytest.raises(ValueError, match="order must be"):
        make_task("file", {**options, "order": "sequential"}, context)


@pytest.mark.parametrize("bad_row", [5, 399])
def test_every_row_is_checked_when_the_task_is_built(tmp_path: Path, bad_row: int) -> None:
    """A row without a prompt anywhere in the file (not only the first) is an error when
    the producer starts, naming the row and counting every bad one."""
    rows = [{"prompt": f"{n} + 1 ="} for n in range(400)]
    rows[bad_row] = {"question": "no prompt column here"}
    rows[bad_row - 1] = {"prompt": 7}  # a number is no prompt text either
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    context = TaskContext(cache_dir=tmp_path, tokenizer=chat_tokenizer())
    options = {
        "path": str(train),
        "rewards": [{"function": "producers.tasks.math_reward:math_accuracy"}],
    }
    with pytest.raises(ValueError, match=f"2 of 400 rows unusable: example {bad_row - 1} ") as err:
        make_task("file", options, context)
    assert f"example {bad_row} has no prompt_ids, messages or prompt text" in str(err.value)

    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text('{"prompt": "1 + 1 ="}\n{"messages": "not a conversation"}\n')
    rows[bad_row] = rows[bad_row - 1] = {"prompt": "fine"}
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"eval.jsonl \(eval\): 1 of 2 rows unusable"):
        make_task("file", {**options, "eval_path": str(evaluation)}, context)
