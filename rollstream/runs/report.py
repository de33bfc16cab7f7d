"""``rollstream report RUN``: a run's trainer metrics as one PNG and one self-contained HTML.

Why: the questions after a run are visual — did reward climb, how stale was the data, how
much did MIS mask, PPO clip and NAV veto, how far behind did each region lag — and the
answers are in the trainer's per-step metrics (``consumers.metrics``), one JSON object per
trainer step. Producers and stream workers export Prometheus metrics only (no files), so
the trainer's JSONL is the report's one source.

**Where the metrics are**, first match wins:

1. ``--metrics FILE`` (repeatable; several files of one run, e.g. before and after a move);
2. ``[trainer] metrics_file`` of the config, when RUN is the config's ``run_id`` (of the
   config ``up`` wrote for RUN when it made it: ``rollstream.config.run_files``);
3. ``<state_dir>/trainer/<RUN>/metrics.jsonl``: the run's trainer directory (checkpoints
   live there too). Point ``[trainer] metrics_file`` there to have reports find it.

The JSONL carries no run id (one file per run). A trainer restarted from a checkpoint
appends and repeats the steps after that checkpoint; the last line of a step wins, which is
the run the weights actually continued from.

**Eval** rows of ``rollstream eval`` (``[producers.eval] metrics_file`` when RUN is the
config's ``run_id``, else ``<state_dir>/eval/<RUN>/metrics.jsonl``) join the step equal to
the version they measured and get a panel of their own; not with ``--metrics``.

**Panels** (x: trainer step): reward (``reward/mean``, ``reward/std``); staleness
(``staleness/mean``, ``staleness/max``); fractions: tokens masked by MIS
(``mis/masked_frac``), clipped by PPO (``clip/frac``), vetoed by NAV (``nav/vetoed_frac``),
truncated by TIS (``tis/truncated_frac``) and sequences dropped by the catastrophic veto
(``veto/catastrophic_frac`` = ``veto/catastrophic_seqs / data/trajectories``); version lag
per region (``staleness/region/<r>``, mean token staleness of each region's data); loss and
train–inference mismatch (``loss/total``, ``mismatch/k3_kl``). A series the run did not
record (say NAV under the decoupled loss) is left out; an empty panel says so.

The HTML embeds the PNG (base64), a summary table (first, last, min, mean, max of every
series), every value per step, and the series as JSON in
``<script type="application/json" id="rollstream-series">`` for other tools.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import click
import orjson

from consumers.config import trainer_home
from producers.config import EvalConfig
from rollstream.config.run_files import run_config
from rollstream.config.settings import RollstreamConfig
from rollstream.runs.compare import write_page


@dataclasses.dataclass(frozen=True)
class Panel:
    """One plot: a title, its y label, and the metric names (or one name prefix) it shows."""

    title: str
    ylabel: str
    names: tuple[str, ...] = ()
    prefix: str | None = None

    def series_names(self, available: set[str]) -> list[str]:
        if self.prefix is not None:
            return sorted(n for n in available if n.startswith(self.prefix))
        return [n for n in self.names if n in available]


PANELS: tuple[Panel, ...] = (
    Panel("reward", "reward", ("reward/mean", "reward/std")),
    Panel("staleness", "versions behind the trainer", ("staleness/mean", "staleness/max")),
    Panel(
        "masked / clipped / vetoed",
        "fraction",
        (
            "mis/masked_frac",
            "clip/frac",
            "nav/vetoed_frac",
            "tis/truncated_frac",
            "veto/catastrophic_frac",
        ),
    ),
    Panel("version lag per region", "mean token staleness", prefix="staleness/region/"),
    Panel("loss and train-inference mismatch", "value", ("loss/total", "mismatch/k3_kl")),
    Panel("held-out eval (x: the version measured)", "reward", ("eval/reward/mean",)),
)

DERIVED = {"veto/catastrophic_frac": ("veto/catastrophic_seqs", "data/trajectories")}
"""Series computed as numerator / denominator of two recorded metrics."""


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """One row per trainer step (sorted by step), and the files they came from."""

    run: str
    rows: list[dict[str, float]]
    sources: tuple[Path, ...]

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of every step that recorded ``name``."""
        steps, values = [], []
        for row in self.rows:
            value = row.get(name)
            if value is not None and math.isfinite(value):
                steps.append(row["step"])
                values.append(value)
        return steps, values

    @property
    def names(self) -> set[str]:
        return {name for row in self.rows for name in row}


def metrics_paths(config: RollstreamConfig, run: str, given: Sequence[Path]) -> list[Path]:
    """Where RUN's metrics are (see the module doc); ``ClickException`` if nowhere."""
    if given:
        missing = [str(p) for p in given if not p.is_file()]
        if missing:
            raise click.ClickException(f"metrics file(s) not found: {', '.join(missing)}")
        return list(given)
    config = run_config(config, run)
    tried: list[Path] = []
    configured = config.trainer.metrics_file
    if configured is not None and run == config.run_id:
        tried.append(Path(configured))
    tried.append(trainer_home(config.state_dir, run, config.policy) / "metrics.jsonl")
    for path in tried:
        if path.is_file():
            return [path]
    shown = ", ".join(str(p) for p in tried)
    raise click.ClickException(f"no metrics for run {run!r}: looked at {shown}; use --metrics")


def eval_path(config: RollstreamConfig, run: str) -> Path | None:
    """RUN's eval metrics (``rollstream eval``), where its config or state dir puts them."""
    config = run_config(config, run)
    configured = config.producers.eval.metrics_file
    if configured is not None and run == config.run_id and Path(configured).is_file():
        return Path(configured)
    path = EvalConfig.default_metrics_file(config.state_dir, run, config.policy)
    return path if path.is_file() else None


def load_metrics(run: str, paths: Sequence[Path], evals: Sequence[Path] = ()) -> RunMetrics:
    """Parse the JSONL files; the last line of a step wins; an eval row (its step is the
    version it measured) joins that step's row; derived series added."""
    by_step: dict[float, dict[str, float]] = {}
    for path in paths:
        for row in _rows(path):
            by_step[row["step"]] = row
    for path in evals:
        for row in _rows(path):
            by_step.setdefault(row["step"], {}).update(row)
    rows = [by_step[step] for step in sorted(by_step)]
    for row in rows:
        for name, (num, den) in DERIVED.items():
            if num in row and row.get(den):
                row[name] = row[num] / row[den]
    return RunMetrics(run, rows, (*paths, *evals))


def _rows(path: Path) -> list[dict[str, float]]:
    """A metrics JSONL's rows, numbers only; each must have a ``step``."""
    found = []
    with path.open("rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as err:
                raise click.ClickException(f"{path}:{number}: not JSON ({err})") from err
            if not isinstance(row, dict) or "step" not in row:
                raise click.ClickException(f"{path}:{number}: a metrics row needs 'step'")
            found.append(
                {
                    k: float(v)
                    for k, v in row.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
            )
    return found


def render_png(metrics: RunMetrics) -> bytes:
    """The panels as one PNG (matplotlib's Agg canvas; no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    available = metrics.names
    fig = Figure(figsize=(11, 3.2 * len(PANELS)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, PANELS, strict=True):
        names = panel.series_names(available)
        for name in names:
            steps, values = metrics.series(name)
            label = name.removeprefix(panel.prefix) if panel.prefix else name
            ax.plot(
                steps, values, label=label, linewidth=1.2, marker="." if len(steps) < 50 else ""
            )
        if names:
            ax.legend(loc="best", fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                "not recorded in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("trainer step")
    fig.suptitle(f"rollstream run {metrics.run}: {len(metrics.rows)} steps")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def plotted_series(metrics: RunMetrics) -> dict[str, dict[str, list[float]]]:
    """Every plotted series: ``{name: {"step": [...], "value": [...]}}``."""
    out: dict[str, dict[str, list[float]]] = {}
    for panel in PANELS:
        for name in panel.series_names(metrics.names):
            steps, values = metrics.series(name)
            out[name] = {"step": steps, "value": values}
    return out


def render_html(metrics: RunMetrics, png: bytes) -> str:
    """A single HTML page: the PNG inline, a summary, every value, the series as JSON."""
    series = plotted_series(metrics)
    names = list(series)
    summary = []
    for name in names:
        values = series[name]["value"]
        summary.append(
            f"<tr><td>{html.escape(name)}</td>"
            + "".join(
                f"<td>{_num(v)}</td>"
                for v in (
                    values[0],
                    values[-1],
                    min(values),
                    sum(values) / len(values),
                    max(values),
                )
            )
            + "</tr>"
        )
    has_time = any("time/unix_s" in row for row in metrics.rows)
    head = "<th>step</th>" + ("<th>time (UTC)</th>" if has_time else "")
    head += "".join(f"<th>{html.escape(n)}</th>" for n in names)
    body = []
    for row in metrics.rows:
        cells = f"<td>{_num(row['step'])}</td>"
        if has_time:
            ts = row.get("time/unix_s")
            when = datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S") if ts else ""
            cells += f"<td>{when}</td>"
        cells += "".join(f"<td>{_num(row[n]) if n in row else ''}</td>" for n in names)
        body.append(f"<tr>{cells}</tr>")
    payload = orjson.dumps({"run": metrics.run, "series": series}).decode()
    payload = payload.replace("</", "<\\/")  # never close the script element early
    sources = ", ".join(html.escape(str(p)) for p in metrics.sources)
    image = base64.b64encode(png).decode()
    title = f"rollstream run {html.escape(metrics.run)}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{title}</h1>
<p>{len(metrics.rows)} trainer steps from {sources}.</p>
<img alt="metrics of run {html.escape(metrics.run)}" src="data:image/png;base64,{image}">
<h2>Summary</h2>
<table><tr><th>series</th><th>first</th><th>last</th><th>min</th><th>mean</th><th>max</th></tr>
{"".join(summary)}
</table>
<h2>Per step</h2>
<details><summary>{len(metrics.rows)} rows</summary>
<table><tr>{head}</tr>
{"".join(body)}
</table></details>
<script type="application/json" id="rollstream-series">{payload}</script>
</body></html>
"""


def _num(value: float) -> str:
    return f"{value:.6g}"


def write_report(metrics: RunMetrics, out: Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``out``; returns their paths."""
    png = render_png(metrics)
    return write_page(out, "report", png, render_html(metrics, png))


@click.command("report")
@click.argument("runs", nargs=-1, required=True, metavar="RUN [OTHER ...]")
@click.option(
    "--metrics",
    "metrics_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Trainer metrics JSONL of the run (repeatable, one RUN only); default: see "
    "`rollstream report -h`.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for report.png and report.html (default ./rollstream-report-RUN), or "
    "compare.png and compare.html with several runs (default ./rollstream-compare-RUN).",
)
@click.pass_obj
def report(
    config: RollstreamConfig,
    runs: tuple[str, ...],
    metrics_files: tuple[Path, ...],
    out: Path | None,
) -> None:
    """Plot RUN's reward, staleness, masked/clipped/vetoed fractions and version lag;
    with several runs (a run and its forks), overlay them metric by metric.

    Metrics come from --metrics, else [trainer] metrics_file (when RUN is the config's
    run_id), else <state_dir>/trainer/RUN/metrics.jsonl. A multi-policy run gets one
    report per policy (OUT/<policy>), unless --policy names one.
    """
    if len(runs) > 1:
        if metrics_files:
            raise click.UsageError("--metrics goes with one RUN")
        config.require_policy()
        _compare(config, runs, out or Path(f"rollstream-compare-{runs[0]}"))
        return
    run = runs[0]
    out = out or Path(f"rollstream-report-{run}")
    if config.policies and not config.policy and not metrics_files:
        for name in sorted(config.policies):  # one report per policy, each its own trainer's
            _report(config.view(name), run, (), out / name, f"policy {name}: ")
    else:
        _report(config, run, metrics_files, out)


def _report(
    config: RollstreamConfig, run: str, given: Sequence[Path], out: Path, label: str = ""
) -> None:
    paths = metrics_paths(config, run, given)
    evaluated = eval_path(config, run)
    metrics = load_metrics(run, paths, [evaluated] if evaluated and not given else [])
    if not metrics.rows:
        raise click.ClickException(f"no metrics rows in {', '.join(map(str, paths))}")
    png_path, html_path = write_report(metrics, out)
    click.echo(f"{label}{len(metrics.rows)} steps → {png_path} and {html_path}")


def _compare(config: RollstreamConfig, runs: Sequence[str], out: Path) -> None:
    from rollstream.runs.compare import write_compare

    loaded = []
    for run in runs:
        evaluated = eval_path(config, run)
        metrics = load_metrics(
            run, metrics_paths(config, run, ()), [evaluated] if evaluated else []
        )
        if not metrics.rows:
            raise click.ClickException(f"no metrics rows for run {run!r}")
        loaded.append(metrics)
    png_path, html_path = write_compare(loaded, out)
    click.echo(f"{len(runs)} runs → {png_path} and {html_path}")
