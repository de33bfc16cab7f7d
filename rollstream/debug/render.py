"""Readable output of replayed records (rich): why a record is where it is, token by token.

Per record: where it was read (topic, partition, offset, time), the dead-letter reason or
the stale verdict from its headers, then the payload. A trajectory shows its run, group,
sample, segments (``v3×4`` = four tokens from version 3), reward and old-logit status, the
prompt and response decoded when a tokenizer is known, and a table per response token:
id, text, version, ``logp_infer``, ``logp_old``, ``log d = logp_old - logp_infer`` and the
discrepancy ratio ``d = exp(log d)`` (rows with ``d`` outside [0.5, 2]
are highlighted). A scored group shows its advantages and per-sample diagnostics first.

A multi-turn episode also shows its turns (``P0 [0:5) v3`` = policy turn 0, response
tokens 0 to 4, generated at version 3; ``E1 [5:8) env`` = the environment's tokens), its
tool calls and why it ended; each turn's text is decoded on its own line, and the token
table names every token's turn, with the environment's tokens dimmed and marked ``env``
(they carry no ``log d``: nobody sampled them, and the trainer never trains them).

Tokenizers (``--tokenizer``): ``auto`` picks one from the record's task
(``producers.tasks``): the tiny vocabulary for the digit tasks, SmolLM2's for
``arithmetic`` when its converted checkpoint is already in the cache (replay never
downloads or converts a model); ``tiny``, ``none`` or a tokenizer directory force one.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rollstream.debug.records import ReplayRecord
from schemas.group import SampleDiagnostics, ScoredGroup
from schemas.trajectory import Trajectory, TurnKind

TINY_TASKS = frozenset(
    {"copy-first-digit-twice", "reverse-3-digits", "repeat-digit", "echo-digits", "propose-solve"}
)
HIGHLIGHT_D = (0.5, 2.0)


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    """What to print: per-token tables or not, and which tokenizer decodes ids."""

    tokens: bool = True
    tokenizer: str = "auto"  # auto | tiny | none | a directory
    cache_dir: Path | None = None
    width: int = 160  # when stdout is not a terminal


class Renderer:
    """Prints records to one console; holds the tokenizers it loaded (per task)."""

    def __init__(self, options: RenderOptions, console: Console | None = None) -> None:
        self.options = options
        self.console = console or Console(
            width=None if _is_terminal() else options.width, soft_wrap=False, highlight=False
        )
        self._tokenizers: dict[str, Any] = {}

    def say(self, *parts: Part) -> None:
        """Print one line of literal text (see ``line``)."""
        self.console.print(line(*parts))

    # --- tokenizers ---------------------------------------------------------------------

    def tokenizer(self, task: str) -> Any:
        """The tokenizer for ``task``'s ids, or None."""
        choice = self.options.tokenizer
        key = task if choice == "auto" else choice
        if key not in self._tokenizers:
            self._tokenizers[key] = self._load_tokenizer(choice, task)
        return self._tokenizers[key]

    def _load_tokenizer(self, choice: str, task: str) -> Any:
        from core.models import TinyTokenizer

        if choice == "none":
            return None
        if choice == "tiny" or (choice == "auto" and task in TINY_TASKS):
            return TinyTokenizer()
        if choice == "auto":
            if task != "arithmetic" or self.options.cache_dir is None:
                return None
            from core.models import SMOLLM2_DIRNAME

            directory = Path(self.options.cache_dir) / "models" / SMOLLM2_DIRNAME
            if not (directory / "config.json").exists():
                return None
            choice = str(directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(choice)

    def text(self, task: str, ids: Any) -> str | None:
        tok = self.tokenizer(task)
        if tok is None:
            return None
        return str(tok.decode([int(t) for t in ids]))

    # --- records ------------------------------------------------------------------------

    def record(self, record: ReplayRecord) -> None:
        when = datetime.fromtimestamp(record.timestamp_ms / 1000, UTC).isoformat(
            timespec="milliseconds"
        )
        key = record.key.decode(errors="replace") if record.key is not None else "-"
        self.console.rule(line(f"{record.where}  {when}  key={key}  {record.kind}"))
        if record.dead_letter is not None:
            d = record.dead_letter
            self.say(
                ("dead letter", "bold red"),
                ": reason ",
                (d.reason, "bold"),
                f" — {d.detail} (from {d.source_topic}[{d.partition}]@{d.offset})",
            )
        if record.stale is not None:
            s = record.stale
            self.say(
                ("stale", "yellow"),
                f": staleness {s.staleness} > limit {s.max_staleness} "
                f"at trainer version {s.trainer_version}",
            )
        for note in record.notes:
            self.say(("malformed header", "red"), f": {note}")
        if record.error is not None:
            size = len(record.value or b"")
            self.say(("undecodable", "red"), f" ({size} bytes): {record.error}")
        if record.trajectory is not None:
            staleness = record.stale.staleness if record.stale is not None else None
            self.trajectory(record.trajectory, staleness=staleness)
        if record.group is not None:
            self.group(record.group)
        if record.announcement is not None:
            a = record.announcement
            kind = "base" if a.is_base else f"delta on v{a.parent} (base v{a.base})"
            self.say(
                f"run {a.run} version {a.version}: {kind}, {a.bytes} bytes at {a.uri}, "
                f"manifest sha256 {a.sha256[:16]}…"
            )

    def trajectory(
        self,
        traj: Trajectory,
        *,
        staleness: int | None = None,
        diagnostics: SampleDiagnostics | None = None,
        title: str | None = None,
    ) -> None:
        segments = ", ".join(
            f"v{int(v)}×{int(n)}"
            for v, n in zip(traj.segment_versions, traj.segment_lengths, strict=False)
        )
        head = title or f"trajectory {traj.trajectory_id}"
        self.say(
            (head, "bold"),
            f"  run {traj.run_id}  group {traj.group_id} "
            f"sample {traj.sample_index}/{traj.group_size}  task {traj.task}"
            + (f"  policy {traj.policy}" if traj.policy else ""),
        )
        adv = "-" if traj.advantage is None else f"{traj.advantage:+.4f}"
        stale = "-" if staleness is None else str(staleness)
        self.say(
            f"  producer {traj.producer_id} ({traj.region})  generated "
            f"{_ms(traj.created_at_ms)} → {_ms(traj.finished_at_ms)}  segments [{segments}]  "
            f"finish {traj.finish_reason}"
        )
        self.say(
            f"  reward {traj.reward:.4f} {_details(traj.reward_details)}  advantage {adv}  "
            f"staleness {stale}  logp_old {traj.old_logits_status}"
        )
        if diagnostics is not None:
            self.say(
                f"  k3 KL(infer‖old) {_f(diagnostics.k3_kl)}  d mean {_f(diagnostics.d_mean)} "
                f"min {_f(diagnostics.d_min)} max {_f(diagnostics.d_max)}"
                + ("  (policy tokens)" if traj.turn_kinds is not None else "")
            )
        turns = traj.covered_turns()
        if traj.turn_kinds is not None or traj.tool_calls or traj.episode_end:
            self.say(
                f"  turns {len(turns) if turns is not None else '?'}  policy tokens "
                f"{_policy_tokens(traj)}/{traj.num_response_tokens}  tool calls "
                f"{traj.tool_calls}  episode_end {traj.episode_end or '-'}"
            )
            if turns is not None:
                self.say("  " + "  ".join(_turn_label(traj, *span) for span in turns))
        prompt = self.text(traj.task, traj.prompt_ids)
        if prompt is not None:
            self.say(f"  prompt   {prompt!r}")
            if traj.turn_kinds is not None and turns is not None:
                for i, (kind, start, end) in enumerate(turns):
                    text = self.text(traj.task, traj.response_ids[start:end])
                    who = "policy" if kind == TurnKind.POLICY else "env   "
                    style = "" if kind == TurnKind.POLICY else "dim"
                    self.say((f"  turn {i} {who} {text!r}", style))
            else:
                response = self.text(traj.task, traj.response_ids)
                self.say(f"  response {response!r}")
        else:
            self.say(f"  prompt ids {traj.prompt_ids.tolist()}")
        if self.options.tokens:
            self.console.print(self.token_table(traj))

    def token_table(self, traj: Trajectory) -> Table:
        """One row per response token: version, logp_infer, logp_old, log d and d."""
        table = Table(box=None, pad_edge=False, header_style="bold")
        multi = traj.turn_kinds is not None
        names = ("#", "turn", "id", "token", "v", "logp_infer", "logp_old", "log d", "d")
        for name in names if multi else tuple(n for n in names if n != "turn"):
            table.add_column(name, justify="left" if name in ("token", "turn") else "right")
        turn_of: list[str] = []
        for i, (kind, start, end) in enumerate(traj.covered_turns() or []):
            turn_of += [f"{'P' if kind == TurnKind.POLICY else 'E'}{i}"] * (end - start)
        versions = (
            traj.token_versions()
            if int(np.sum(traj.segment_lengths)) == traj.num_response_tokens
            else None
        )
        tok = self.tokenizer(traj.task)
        old = traj.logp_old
        for i, token in enumerate(traj.response_ids.tolist()):
            infer = float(traj.logp_infer[i]) if i < len(traj.logp_infer) else math.nan
            row_old = float(old[i]) if old is not None and i < len(old) else None
            turn = turn_of[i] if i < len(turn_of) else "?"
            env = turn.startswith("E")
            log_d = None if row_old is None or env else row_old - infer
            d = None if log_d is None else math.exp(log_d)
            style = "dim" if env else None
            if d is not None and not HIGHLIGHT_D[0] <= d <= HIGHLIGHT_D[1]:
                style = "bold red"
            cells = [
                str(i),
                str(token),
                repr(tok.decode([token])) if tok is not None else "",
                "env" if env else (str(int(versions[i])) if versions is not None else "?"),
                f"{infer:.5f}",
                "-" if row_old is None else f"{row_old:.5f}",
                "-" if log_d is None else f"{log_d:+.5f}",
                "-" if d is None else f"{d:.5f}",
            ]
            if multi:
                cells.insert(1, turn)
            table.add_row(*map(line, cells), style=style)
        return table

    def group(self, group: ScoredGroup) -> None:
        state = "complete" if group.complete else "PARTIAL"
        self.say(
            (f"scored group {group.group_id}", "bold"),
            f"  run {group.run_id}  {state} "
            f"{len(group.samples)}/{group.group_size}  reward mean {_f(group.reward_mean)} "
            f"std {_f(group.reward_std)}  trainer version seen {group.trainer_version_seen}  "
            f"emitted {_ms(group.emitted_at_ms)}",
        )
        table = Table(header_style="bold")
        for name in (
            "sample",
            "trajectory",
            "reward",
            "advantage",
            "staleness",
            "segments",
            "turns",
            "logp_old",
            "k3 KL",
            "d mean",
            "d min",
            "d max",
        ):
            left = name in ("trajectory", "segments")
            table.add_column(name, justify="left" if left else "right")
        for traj, diag in zip(group.samples, group.diagnostics, strict=True):
            row = (
                str(traj.sample_index),
                traj.trajectory_id,
                f"{traj.reward:.4f}",
                "-" if traj.advantage is None else f"{traj.advantage:+.4f}",
                str(diag.staleness),
                " ".join(
                    f"v{int(v)}×{int(n)}"
                    for v, n in zip(traj.segment_versions, traj.segment_lengths, strict=False)
                ),
                _turns_cell(traj),
                traj.old_logits_status,
                _f(diag.k3_kl),
                _f(diag.d_mean),
                _f(diag.d_min),
                _f(diag.d_max),
            )
            table.add_row(*map(line, row))
        self.console.print(table)
        if self.options.tokens:
            for traj, diag in zip(group.samples, group.diagnostics, strict=True):
                self.trajectory(traj, staleness=diag.staleness, diagnostics=diag)

    def metrics(self, title: str, metrics: dict[str, float]) -> None:
        """Loss terms and other named numbers, full precision."""
        table = Table(title=title, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name in sorted(metrics):
            table.add_row(line(name), repr(float(metrics[name])))
        self.console.print(table)


def _policy_tokens(traj: Trajectory) -> str:
    try:
        return str(traj.num_policy_tokens)
    except (ValueError, TypeError, IndexError):
        return "?"


def _turn_label(traj: Trajectory, kind: TurnKind, start: int, end: int) -> str:
    """``P0 [0:5) v3`` for a policy turn (its versions), ``E1 [5:8) env`` for the env's."""
    index = next(i for i, span in enumerate(traj.turns()) if span[1] == start)
    if kind != TurnKind.POLICY:
        return f"E{index} [{start}:{end}) env"
    label = f"P{index} [{start}:{end})"
    if int(np.sum(traj.segment_lengths)) != traj.num_response_tokens:
        return f"{label} v?"
    versions = sorted(set(traj.token_versions()[start:end].tolist()))
    return f"{label} " + "→".join(f"v{v}" for v in versions)


def _turns_cell(traj: Trajectory) -> str:
    """Turns, tool calls and episode end of a group's sample, in one short cell."""
    if traj.turn_kinds is None and not traj.tool_calls and not traj.episode_end:
        return "1"
    turns = traj.covered_turns()
    count = "?" if turns is None else str(len(turns))
    return f"{count} ({traj.tool_calls} tools, {traj.episode_end or '-'})"


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty()


#: Control characters (Cc), format characters (Cf: bidi marks and overrides, zero-width
#: ones) and the line and paragraph separators (Zl, Zp): each can make printed text
#: look other than it is, or break a line where the record has none.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
Part = str | tuple[str, str]


def line(*parts: Part) -> Text:
    """Text that prints as itself: never read as Rich markup or emoji codes, and control
    characters (escape sequences: a terminal hyperlink, a screen clear), bidi marks and
    overrides and line separators shown as ``\\x1b``-style escapes. A record's fields are
    whatever its writer chose, so everything printed from one goes through here; a part
    may be ``(text, style)``."""
    text = Text()
    for part in parts:
        value, style = (part, "") if isinstance(part, str) else part
        text.append(neutral(value), style=style)
    return text


def neutral(value: object) -> str:
    """``value`` with control, format and separator characters as visible escapes."""
    text = str(value)
    if not any(_unsafe(c) for c in text):
        return text
    return "".join(c.encode("unicode_escape").decode() if _unsafe(c) else c for c in text)


def _unsafe(char: str) -> bool:
    return unicodedata.category(char) in _UNSAFE_CATEGORIES


def _f(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.5g}"


def _ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _details(details: dict[str, Any]) -> str:
    if not details:
        return ""
    import orjson

    return orjson.dumps(details).decode()
