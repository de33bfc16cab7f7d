"""The ``file`` task: your prompts from a data file, scored by your reward functions.

Rows come from JSONL, Parquet, CSV (cells read as text) or a ``datasets`` dataset saved
with ``save_to_disk`` (``read_examples``). ``columns`` maps the names used here to the
file's own (``{prompt = "question"}``). A row's prompt is, first found:

* ``prompt_ids``: token ids, used as they are;
* ``messages``, or a ``prompt`` that is a list of ``{"role", "content"}`` messages: a
  conversation, rendered with the tokenizer's chat template (``system_prompt`` is put
  first when the conversation has no system message; ``chat_template_kwargs`` are passed
  to ``apply_chat_template``);
* ``prompt`` text: encoded as it is, or as one user message when ``chat`` is set.

``order = "epochs"`` walks the rows without replacement, epoch after epoch, each epoch
shuffled by ``shuffle_seed``; a prompt's position in that walk travels in its records'
``reward_details["prompt_position"]`` and in the producer's ledger, and a restarted
producer goes on from the ledger (``resume``): positions whose groups were delivered are
never given again, the others (in flight at a crash or a stop) are given first. The
default ``order = "random"`` draws rows with replacement from the producer's RNG.

Scoring is either ``rewards``, a list of TRL-style reward functions with weights
(``producers.tasks.rewards``: the whole group at once, sync or async, contained), or the older
``reward``, one function per sample with the signature ``reward(response_text: str,
response_ids: list[int], example: dict) -> float | tuple[float, dict]``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from producers.tasks.base import (
    Prompt,
    TaskContext,
    chat_ids,
    hf_tokenizer,
    load_object,
    register_task,
)
from producers.tasks.rewards import RewardSet, Score

#: The names a row's prompt is read from, in this order.
PROMPT_COLUMNS = ("prompt_ids", "messages", "prompt")


def read_examples(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL, Parquet or CSV file, or of a ``datasets`` dataset directory (a
    ``DatasetDict`` needs ``split``), as dicts; an unreadable source is a ``ValueError``
    naming it."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"prompt source {path} does not exist")
    if path.is_dir():
        return _dataset_rows(path, split)
    if path.suffix in (".parquet", ".csv"):
        try:
            return _table_rows(path)
        except Exception as exc:  # pyarrow's own errors, named for the user
            raise ValueError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(
            f"{path}: unknown format {path.suffix!r} (.jsonl, .parquet, .csv, or a directory "
            "written by datasets' save_to_disk)"
        )
    rows = []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{number}: a row is a JSON object")
                rows.append(row)
    return rows


def _table_rows(path: Path) -> list[dict[str, Any]]:
    """A Parquet file's rows, or a CSV file's with every cell as text (as written)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    table = pcsv.read_csv(path)
    return table.cast(pa.schema([(name, pa.string()) for name in table.column_names])).to_pylist()


def _dataset_rows(path: Path, split: str | None) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(path))
    except Exception as exc:  # not a save_to_disk directory
        raise ValueError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, DatasetDict):
        if split is None or split not in loaded:
            raise ValueError(
                f"{path} holds the splits {sorted(loaded)}: choose one with 'split'"
                + (f" ({split!r} is not one)" if split else "")
            )
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"{path} is a single dataset: leave out 'split'")
    return loaded.to_list()


def mapped_rows(
    rows: list[dict[str, Any]], columns: Mapping[str, str], source: str
) -> list[dict[str, Any]]:
    """``rows`` with each of ``columns``' file columns also under the name used here;
    a mapped column that no row has is a ``ValueError`` listing the file's columns."""
    present = {key for row in rows for key in row}
    for ours, theirs in columns.items():
        if ours not in PROMPT_COLUMNS:
            raise ValueError(
                f"columns: {ours!r} is not a name the file task reads ({', '.join(PROMPT_COLUMNS)})"
            )
        if theirs not in present:
            raise ValueError(
                f"columns: {theirs!r} is not a column of {source} (columns: {sorted(present)})"
            )
    if not any(name in present or name in columns for name in PROMPT_COLUMNS):
        raise ValueError(
            f"{source} has none of the columns {', '.join(PROMPT_COLUMNS)} "
            f"(columns: {sorted(present)}): map one with 'columns'"
        )
    return [{**row, **{ours: row.get(theirs) for ours, theirs in columns.items()}} for row in rows]


def is_conversation(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


@dataclass
class FileTask:
    """Prompts from rows of a file, scored by ``rewards`` (TRL style) or ``reward_fn``."""

    examples: list[dict[str, Any]]
    tokenizer: Any
    reward_fn: Callable[..., Any] | None = None
    rewards: RewardSet | None = None
    name: str = "file"
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    chat: bool = False
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    order: Literal["random", "epochs"] = "random"
    shuffle_seed: int = 0
    next_position: int = 0
    """``order = "epochs"``: the next position not given yet."""
    redo: list[int] = field(default_factory=list)
    """``order = "epochs"``: positions given before a restart but never delivered."""
    eval_examples: list[dict[str, Any]] = field(default_factory=list)
    """The held-out rows ``rollstream eval`` measures each version on; never sampled."""

    def __post_init__(self) -> None:
        if self.order not in ("random", "epochs"):
            raise ValueError(f"order must be 'random' or 'epochs', not {self.order!r}")

    def sample(self, rng: random.Random) -> Prompt:
        meta: dict[str, Any] = {}
        if self.order == "epochs":
            position = self.redo.pop(0) if self.redo else self._advance()
            index = self.epoch_order(position // len(self.examples))[position % len(self.examples)]
            meta["position"] = position
        else:
            index = rng.randrange(len(self.examples))
        example = self.examples[index]
        ids, text, shown = self.render(index, example)
        return Prompt(ids, {**meta, "example": example, "index": index, "prompt": shown}, text)

    def eval_prompts(self) -> list[Prompt]:
        """The eval split's prompts, in file order (``rollstream eval``)."""
        if not self.eval_examples:
            raise ValueError(
                f"task {self.name!r} has no eval split: set the task option eval_split "
                "(a split of the dataset) or eval_path (a file of its own)"
            )
        prompts = []
        for index, example in enumerate(self.eval_examples):
            ids, text, shown = self.render(index, example)
            prompts.append(Prompt(ids, {"example": example, "index": index, "prompt": shown}, text))
        return prompts

    def _advance(self) -> int:
        position, self.next_position = self.next_position, self.next_position + 1
        return position

    def epoch_order(self, epoch: int) -> list[int]:
        """The row indices of ``epoch`` in the order they are given."""
        order = list(range(len(self.examples)))
        random.Random(self.shuffle_seed * 1_000_003 + epoch).shuffle(order)
        return order

    def resume(self, delivered: set[int]) -> None:
        """Go on after a restart: ``delivered`` are the positions the ledger says were
        delivered; every earlier position not among them is given again first."""
        if self.order != "epochs" or not delivered:
            return
        self.next_position = max(delivered) + 1
        self.redo = sorted(set(range(self.next_position)) - delivered)

    def render(self, index: int, example: dict[str, Any]) -> tuple[list[int], str | None, Any]:
        """Token ids, text and the prompt as reward functions see it (text or messages)."""
        kind, value = prompt_of(index, example)
        if kind == "prompt_ids":
            return list(value), None, example.get("prompt")
        if kind == "messages":
            return self._chat(index, value), None, value
        text = value
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (task option 'tokenizer')")
        if self.chat:
            return self._chat(index, [{"role": "user", "content": text}]), text, text
        return list(self.tokenizer.encode(text)), text, text

    def _chat(self, index: int, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("conversational prompts need a tokenizer with a chat template")
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        try:
            return chat_ids(self.tokenizer, messages, **self.chat_template_kwargs)
        except Exception as exc:
            raise ValueError(f"example {index}: the chat template failed: {exc}") from exc

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        """The older per-sample ``reward`` function's score of one response."""
        if self.reward_fn is None:
            raise TypeError("this file task scores whole groups: use score_group")
        text = self._decode(response_ids)
        result = self.reward_fn(text, list(response_ids), prompt.meta["example"])
        reward, details = result if isinstance(result, tuple) else (result, {})
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward function {self.reward_fn!r} returned {reward}")
        if not isinstance(details, dict):
            raise TypeError(f"reward details must be a dict, got {type(details).__name__}")
        return reward, {**details, **self.provenance(prompt)}

    @staticmethod
    def provenance(prompt: Prompt) -> dict[str, int]:
        """Which row (and, in epochs, which position) a record's prompt was."""
        found = {"example_index": prompt.meta["index"]}
        if "position" in prompt.meta:
            found["prompt_position"] = prompt.meta["position"]
        return found

    async def score_group(self, prompt: Prompt, responses: Sequence[Sequence[int]]) -> list[Score]:
        """Every response of a group, scored by the reward functions together."""
        if self.rewards is None:
            return [Score(*self.reward(prompt, ids)) for ids in responses]
        shown = prompt.meta["prompt"]
        texts = [self._decode(ids) for ids in responses]
        if is_conversation(shown):
            completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        example = prompt.meta["example"]
        size = len(responses)
        columns = {key: [value] * size for key, value in example.items() if key != "prompt"}
        scores = await self.rewards.score([shown] * size, completions, responses, columns)
        for score in scores:
            score.details.update(self.provenance(prompt))
        return scores

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def prompt_of(index: int, example: dict[str, Any]) -> tuple[str, Any]:
    """Which of ``PROMPT_COLUMNS`` gives row ``index``'s prompt, and its value, checked
    for shape (no tokenizer needed); ``ValueError`` naming the row if none does."""
    if example.get("prompt_ids") is not None:
        ids = example["prompt_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ValueError(f"example {index}: prompt_ids must be a list of token ids")
        return "prompt_ids", ids
    conversation = example.get("messages")
    if conversation is None and is_conversation(example.get("prompt")):
        conversation = example["prompt"]
    if conversation is not None:
        if not is_conversation(conversation):
            raise ValueError(
                f"example {index}: messages must be a list of {{role, content}} objects"
            )
        return "messages", conversation
    text = example.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"example {index} has no prompt_ids, messages or prompt text")
    return "prompt", text


def check_rows(examples: list[dict[str, Any]], source: str) -> None:
    """Every row of ``source`` has a prompt of a usable shape: a bad row is an error when
    the producer starts (the first few named, all counted), not a crash mid-run."""
    problems: list[str] = []
    for index, example in enumerate(examples):
        try:
            prompt_of(index, example)
        except ValueError as err:
            problems.append(str(err))
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise ValueError(f"{source}: {len(problems)} of {len(examples)} rows unusable: {shown}")


@dataclass(frozen=True, kw_only=True)
class PromptOptions:
    """The file task's options past its data and rewards: the held-out rows, how a row
    becomes a prompt, the order rows are drawn in, and the sampling limits."""

    eval_path: str | None = None
    eval_split: str | None = None
    chat: bool = False
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    order: Literal["random", "epochs"] = "random"
    shuffle_seed: int = 0
    max_new_tokens: int = 128
    stop_token_ids: list[int] | None = None


@register_task("file", forwards=PromptOptions)
def file_task(
    context: TaskContext,
    path: str,
    reward: str | None = None,
    rewards: list[dict[str, Any]] | None = None,
    tokenizer: str | None = None,
    name: str = "file",
    columns: dict[str, str] | None = None,
    split: str | None = None,
    **options: Any,
) -> FileTask:
    """Options: ``path`` (.jsonl, .parquet, .csv or a ``save_to_disk`` directory, with
    ``split`` for a ``DatasetDict``), ``columns`` (our name -> the file's column),
    ``rewards`` (a list of ``{function, weight, name, timeout_s}``) or ``reward`` (a
    per-sample function), ``tokenizer`` (a model spec whose tokenizer to use; none: the
    engine's), ``name``, and ``PromptOptions``: ``eval_split`` and/or ``eval_path`` (the
    held-out rows: a split of ``eval_path``, default ``path``, or all of ``eval_path``),
    ``chat``, ``system_prompt``, ``chat_template_kwargs``, ``order`` (``random`` or
    ``epochs``), ``shuffle_seed``, ``max_new_tokens``, ``stop_token_ids``. Behind the
    gateway neither reward option is needed: its agents score the episodes."""
    prompts = PromptOptions(**options)
    if reward is not None and rewards is not None:
        raise ValueError("the file task takes either 'rewards' (a list) or 'reward', not both")
    if reward is None and rewards is None and not context.agents_score:
        raise ValueError(
            "the file task needs 'rewards' (a list) or 'reward' (only the gateway's agents "
            "report rewards of their own)"
        )
    examples = read_examples(Path(path), split)
    if not examples:
        raise ValueError(f"{path} holds no examples")
    examples = mapped_rows(examples, columns or {}, path)
    check_rows(examples, path)
    held_out = _held_out_rows(path, split, columns, prompts)
    tok: Any = None
    if tokenizer is not None or context.tokenizer is not None:
        tok = hf_tokenizer(context, tokenizer)
    stops = prompts.stop_token_ids
    if stops is None:
        eos = getattr(tok, "eos_token_id", None)
        stops = [eos] if eos is not None else []
    task = FileTask(
        examples,
        tok,
        reward_fn=load_object(reward) if reward is not None else None,
        rewards=RewardSet.from_configs(rewards) if rewards is not None else None,
        name=name,
        stop_token_ids=stops,
        eval_examples=held_out,
        chat=prompts.chat,
        system_prompt=prompts.system_prompt,
        chat_template_kwargs=prompts.chat_template_kwargs or {},
        order=prompts.order,
        shuffle_seed=prompts.shuffle_seed,
        max_new_tokens=prompts.max_new_tokens,
    )
    task.render(0, examples[0])  # a prompt that cannot be rendered fails here, not later
    if held_out:
        task.render(0, held_out[0])
    return task


def _held_out_rows(
    path: str, split: str | None, columns: dict[str, str] | None, prompts: PromptOptions
) -> list[dict[str, Any]]:
    """The eval rows: a split of ``eval_path`` (default ``path``) or all of it; none when
    neither is given. The training rows themselves are refused."""
    if prompts.eval_path is None and prompts.eval_split is None:
        return []
    source = prompts.eval_path or path
    if (Path(source), prompts.eval_split) == (Path(path), split):
        raise ValueError(f"the eval split is the training data ({source}, split {split})")
    held_out = read_examples(Path(source), prompts.eval_split)
    if not held_out:
        raise ValueError(f"the eval split of {source} holds no examples")
    held_out = mapped_rows(held_out, columns or {}, source)
    check_rows(held_out, f"{source} (eval)")
    return held_out
