"""``rollstream export-dataset``: a run's log as a Hugging Face dataset on disk.

Why: the scored topic and the trainer's ledger together say exactly which completions the
policy produced, how they were rewarded and which step trained them. That is a dataset
for supervised fine-tuning, distillation or rejection sampling, and it should leave the
run in the format those tools read (``datasets.load_from_disk``), not as Kafka records.

Rows are scored samples of the run (``rollouts.scored``), one per trajectory, first copy
only. By default only the trajectories the trainer's ledger says it trained, each with its
``step``; ``include_untrained`` keeps the rest too (``step`` and ``staleness`` null).
``staleness`` is what the trainer measured: the version it trained (``step - 1``) minus the
oldest version that generated a token of the sample. Text columns are the tokens decoded
by the run's tokenizer as the model saw them, chat template included; the id columns are
the exact tokens, and ``completion_mask`` marks the policy's own (1) against the
environment's (0), which no loss may train on. Eval completions are not in the log (the
evaluator publishes nothing), so there is no eval filter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rollstream.config.run_files import run_config
from rollstream.config.settings import RollstreamConfig
from rollstream.runs.export import OUT_DIRECTORY, ExportError, staged_directory

if TYPE_CHECKING:
    from schemas.group import ScoredGroup
    from schemas.trajectory import Trajectory

#: Provenance written beside the dataset: which run, topic, ledger and filter it is.
PROVENANCE_NAME = "rollstream_dataset.json"


@dataclass(frozen=True)
class DatasetFilter:
    """Which scored samples become rows."""

    include_untrained: bool = False
    min_reward: float | None = None
    max_staleness: int | None = None  # rows of untrained samples have none: left out

    def keeps(self, traj: Trajectory, staleness: int | None, trained: bool) -> bool:
        if not trained and not self.include_untrained:
            return False
        if self.min_reward is not None and not traj.reward >= self.min_reward:  # NaN: out
            return False
        return self.max_staleness is None or (
            staleness is not None and staleness <= self.max_staleness
        )


@dataclass
class DatasetCounts:
    """What the export read and why samples were left out."""

    records: int = 0
    undecodable: int = 0
    other_runs: int = 0
    samples: int = 0
    duplicates: int = 0
    malformed: int = 0
    filtered: int = 0
    rows: int = 0
    trained_not_found: set[str] = field(default_factory=set)


def trained_steps(entries: Iterable[tuple[int, list[str]]]) -> dict[str, int]:
    """Trajectory id → the step that trained it, from the trainer's ledger lines."""
    steps: dict[str, int] = {}
    for step, ids in entries:
        for tid in ids:
            steps.setdefault(tid, step)
    return steps


def _text(tokenizer: Any, ids: Any) -> str | None:
    return None if tokenizer is None else str(tokenizer.decode([int(t) for t in ids]))


def sample_row(
    traj: Trajectory, step: int | None, staleness: int | None, tokenizer: Any
) -> dict[str, Any]:
    """One dataset row; ``ValueError`` when the sample's turn layout does not add up."""
    from schemas.trajectory import TurnKind

    turns = traj.covered_turns()
    if turns is None:
        raise ValueError(f"turns of {traj.trajectory_id} do not cover its response")
    messages = [{"role": "user", "content": _text(tokenizer, traj.prompt_ids)}]
    observer = "tool" if traj.tool_calls else "user"
    for kind, start, end in turns:
        role = "assistant" if kind == TurnKind.POLICY else observer
        messages.append({"role": role, "content": _text(tokenizer, traj.response_ids[start:end])})
    return {
        "run_id": traj.run_id,
        "policy": traj.policy,
        "task": traj.task,
        "group_id": traj.group_id,
        "trajectory_id": traj.trajectory_id,
        "sample_index": traj.sample_index,
        "step": step,
        "staleness": staleness,
        "prompt": messages[0]["content"],
        "completion": _text(tokenizer, traj.response_ids),
        "messages": messages if tokenizer is not None else [],
        "prompt_ids": [int(t) for t in traj.prompt_ids],
        "completion_ids": [int(t) for t in traj.response_ids],
        "completion_mask": traj.loss_mask.astype("int8").tolist(),
        "reward": float(traj.reward),
        "reward_details": json.dumps(traj.reward_details, sort_keys=True, default=str),
        "advantage": None if traj.advantage is None else float(traj.advantage),
        "versions": [int(v) for v in traj.segment_versions],
        "segment_lengths": [int(n) for n in traj.segment_lengths],
        "finish_reason": traj.finish_reason,
        "episode_end": traj.episode_end,
    }


def dataset_rows(
    groups: Iterable[ScoredGroup],
    steps: Mapping[str, int],
    keep: DatasetFilter,
    tokenizer: Any,
    counts: DatasetCounts,
) -> Iterator[dict[str, Any]]:
    """The rows of ``groups``' samples that ``keep`` keeps, each trajectory once;
    ``steps`` is ``trained_steps`` of the ledger."""
    seen: set[str] = set()
    for group in groups:
        for traj in group.samples:
            counts.samples += 1
            if traj.trajectory_id in seen:
                counts.duplicates += 1
                continue
            seen.add(traj.trajectory_id)
            step = steps.get(traj.trajectory_id)
            staleness = None if step is None else step - 1 - traj.min_version
            if not keep.keeps(traj, staleness, step is not None):
                counts.filtered += 1
                continue
            try:
                row = sample_row(traj, step, staleness, tokenizer)
            except (ValueError, TypeError):
                counts.malformed += 1
                continue
            counts.rows += 1
            yield row
    counts.trained_not_found = set(steps) - seen


def dataset_features() -> Any:
    """The dataset's column types, fixed so that an export with no multi-turn or untrained
    rows has the same schema as one with them."""
    from datasets import Features, Sequence, Value

    ints = Sequence(Value("int64"))
    return Features(
        {
            "run_id": Value("string"),
            "policy": Value("string"),
            "task": Value("string"),
            "group_id": Value("string"),
            "trajectory_id": Value("string"),
            "sample_index": Value("int64"),
            "step": Value("int64"),
            "staleness": Value("int64"),
            "prompt": Value("string"),
            "completion": Value("string"),
            "messages": [{"role": Value("string"), "content": Value("string")}],
            "prompt_ids": ints,
            "completion_ids": ints,
            "completion_mask": Sequence(Value("int8")),
            "reward": Value("float64"),
            "reward_details": Value("string"),
            "advantage": Value("float64"),
            "versions": ints,
            "segment_lengths": ints,
            "finish_reason": Value("string"),
            "episode_end": Value("string"),
        }
    )


def write_dataset(rows: list[dict[str, Any]], out: Path, provenance: dict[str, Any]) -> None:
    """``rows`` as a ``datasets`` dataset at ``out`` (new or empty), whole or not at all."""
    from datasets import Dataset

    dataset = Dataset.from_list(rows, features=dataset_features())
    with staged_directory(out) as staging:
        dataset.save_to_disk(str(staging))
        (staging / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")


def read_scored_groups(
    config: RollstreamConfig, run: str, counts: DatasetCounts, timeout_s: float
) -> Iterator[ScoredGroup]:
    """The run's scored groups on its scored topic, committed records only."""
    from infra.services import Services
    from rollstream.runs.reads import read_topic
    from schemas.group import decode_group

    client = Services(config).running(s3=False).kafka.client_config()
    for msg in read_topic(client, config.trainer.topics.scored, timeout_s):
        counts.records += 1
        try:
            group = decode_group(msg.value())
        except Exception:  # any defect of a record: counted, the export goes on
            counts.undecodable += 1
            continue
        if group.run_id != run:
            counts.other_runs += 1
            continue
        yield group


@click.command("export-dataset")
@click.argument("run", required=False)
@OUT_DIRECTORY
@click.option(
    "--include-untrained",
    is_flag=True,
    help="Also the scored samples the trainer did not train (stale, filtered, not yet).",
)
@click.option("--min-reward", type=float, help="Only samples rewarded at least this.")
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    help="Only trained samples at most this many versions behind the trainer.",
)
@click.option(
    "--ledger",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Trainer ledger (default: the one the trainer of this config writes).",
)
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, help="Read timeout (s).")
@click.pass_obj
def export_dataset(
    config: RollstreamConfig,
    run: str | None,
    out: Path,
    include_untrained: bool,
    min_reward: float | None,
    max_staleness: int | None,
    ledger: Path | None,
    timeout_s: float,
) -> None:
    """Write RUN's (default: the config's run) trained samples as a Hugging Face dataset:
    prompt, completion, messages, token ids, reward, versions and the step that trained
    each."""
    from consumers.checkpoint import TrainingLedger
    from consumers.config import ledger_path
    from core.models import load_tokenizer

    config.require_policy()  # each policy has its own topics and ledger
    if min_reward is not None and not math.isfinite(min_reward):
        raise click.BadParameter("must be a finite number", param_hint="--min-reward")
    run = run or config.run_id
    config = run_config(config, run)  # a run made by `up` keeps its ledger in its run dir
    ledger = ledger or ledger_path(config, config.trainer)
    if not ledger.is_file():
        raise click.ClickException(
            f"no trainer ledger at {ledger}: export on the trainer's machine with its "
            "config, or pass --ledger"
        )
    keep = DatasetFilter(include_untrained, min_reward, max_staleness)
    counts = DatasetCounts()
    spec = config.producers.engine.model
    tokenizer = load_tokenizer(spec, config.cache_dir)
    groups = read_scored_groups(config, run, counts, timeout_s)
    rows = list(
        dataset_rows(groups, trained_steps(TrainingLedger.read(ledger)), keep, tokenizer, counts)
    )
    if not rows:
        raise click.ClickException(f"no sample of run {run!r} passed the filter: nothing written")
    provenance = {
        "run_id": run,
        "topic": config.trainer.topics.scored,
        "ledger": str(ledger),
        "model": spec,
        "filter": {
            "include_untrained": include_untrained,
            "min_reward": min_reward,
            "max_staleness": max_staleness,
        },
        "rows": counts.rows,
    }
    try:
        write_dataset(rows, out, provenance)
    except ExportError as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"{counts.rows} rows -> {out} (read {counts.records} records, {counts.samples} samples; "
        f"left out: {counts.filtered} by the filter, {counts.duplicates} copies, "
        f"{counts.malformed} malformed, {counts.undecodable} undecodable records, "
        f"{counts.other_runs} of other runs)"
    )
    if counts.trained_not_found:
        click.echo(
            f"warning: {len(counts.trained_not_found)} trained samples of the ledger are not "
            "on the scored topic (its retention removed them?)",
            err=True,
        )
