"""``rollstream report RUN OTHER ...``: several runs' metrics overlaid, one line per run.

Why: a fork (``rollstream fork``) trains a run's recorded data again with one thing
changed; the question is what changed, step by step, against the run and the other arms.
Each panel is one metric, each run one line: the reward of the data as recorded (a fork
trains the same data, so its reward line is the run's), the loss, the PPO-clipped and
MIS-masked fractions, how far the trained policy is from the policy that generated the
data (``offpolicy/k3_kl``), and the held-out eval reward where a run has one. The HTML
embeds the PNG, a table of each metric's last and mean value per run, and the series as
JSON in ``<script type="application/json" id="rollstream-series">``.
"""

from __future__ import annotations

import html
import io
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import orjson


class RunMetrics(Protocol):
    """What is compared of a run (``rollstream.runs.report.RunMetrics``)."""

    @property
    def run(self) -> str: ...

    def series(self, name: str) -> tuple[list[float], list[float]]: ...


COMPARED: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward of the data as recorded"),
    ("loss/total", "loss"),
    ("clip/frac", "fraction clipped by PPO"),
    ("mis/masked_frac", "fraction masked by MIS"),
    ("offpolicy/k3_kl", "KL(generating policy ‖ trained policy), k3"),
    ("eval/reward/mean", "held-out eval reward (x: the version measured)"),
)
"""The metrics overlaid, each with its panel title."""


def render_compare_png(runs: Sequence[RunMetrics]) -> bytes:
    """One panel per compared metric, one line per run (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.0 * len(COMPARED)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(COMPARED), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, title) in zip(axes, COMPARED, strict=True):
        drawn = 0
        for run in runs:
            steps, values = run.series(name)
            if steps:
                ax.plot(steps, values, label=run.run, linewidth=1.2)
                drawn += 1
        if drawn:
            ax.legend(loc="best", fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} ({name})", fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("trainer step")
    fig.suptitle("rollstream runs: " + ", ".join(r.run for r in runs))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def compared_series(runs: Sequence[RunMetrics]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """``{run: {metric: {"step": [...], "value": [...]}}}`` of every compared metric."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for run in runs:
        for name, _title in COMPARED:
            steps, values = run.series(name)
            if steps:
                out.setdefault(run.run, {})[name] = {"step": steps, "value": values}
    return out


def render_compare_html(runs: Sequence[RunMetrics], png: bytes) -> str:
    import base64

    series = compared_series(runs)
    head = "".join(f"<th>{html.escape(r.run)} last</th><th>mean</th>" for r in runs)
    rows = []
    for name, _title in COMPARED:
        cells = []
        for run in runs:
            values = series.get(run.run, {}).get(name, {}).get("value", [])
            cells.append(
                f"<td>{values[-1]:.6g}</td><td>{statistics.fmean(values):.6g}</td>"
                if values
                else "<td>-</td><td>-</td>"
            )
        rows.append(f"<tr><th>{html.escape(name)}</th>{''.join(cells)}</tr>")
    data = orjson.dumps(series).decode().replace("</", "<\\/")
    image = base64.b64encode(png).decode()
    return (
        "<!doctype html><meta charset=utf-8><title>rollstream compare</title>"
        f"<h1>{html.escape(', '.join(r.run for r in runs))}</h1>"
        f'<img alt="compared metrics" src="data:image/png;base64,{image}">'
        f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"
        f'<script type="application/json" id="rollstream-series">{data}</script>'
    )


def write_page(out: Path, name: str, png: bytes, html_text: str) -> tuple[Path, Path]:
    """Write ``<name>.png`` and ``<name>.html`` into ``out``, each whole or not at all (a
    browser reloading the page never reads half a file); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    png_path, html_path = out / f"{name}.png", out / f"{name}.html"
    for path, data in ((png_path, png), (html_path, html_text.encode())):
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        partial.replace(path)
    return png_path, html_path


def write_compare(runs: Sequence[RunMetrics], out: Path) -> tuple[Path, Path]:
    """Write ``compare.png`` and ``compare.html`` into ``out``; returns their paths."""
    png = render_compare_png(runs)
    return write_page(out, "compare", png, render_compare_html(runs, png))
