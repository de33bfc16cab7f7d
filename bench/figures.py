"""Small figures the benchmarks share: a run's trainer metrics, moving means, mean ± sd."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path


def trainer_rows(run_dir: Path) -> list[dict[str, float]]:
    """The trainer's per-step metrics of a ``rollstream up`` run (its ``trainer.jsonl``)."""
    text = (run_dir / "trainer.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def moving_mean(values: Sequence[float], window: int = 10) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``mean ± sd`` of ``values`` (the one value, or ``-`` for none)."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def replace_block(doc: Path, begin: str, end: str, text: str) -> None:
    """Put ``text`` between the ``begin`` and ``end`` markers of ``doc`` (appended with
    its markers when they are not there yet): the generated part of a hand-written page."""
    block = f"{begin}\n{text}\n{end}"
    page = doc.read_text() if doc.exists() else ""
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(page)
