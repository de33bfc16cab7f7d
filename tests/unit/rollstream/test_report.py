"""``rollstream report``: a small metrics file becomes a PNG and an HTML page with its series."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from core.config import to_toml
from rollstream.cli.main import main

STEPS = [
    {
        "step": step,
        "version": step - 1,
        "time/unix_s": 1_750_000_000.0 + 2 * step,
        "reward/mean": 0.1 * step,
        "reward/std": 0.05,
        "staleness/mean": 0.5 * step,
        "staleness/max": float(step),
        "staleness/region/eu": 0.25 * step,
        "staleness/region/us": 1.5,
        "mis/masked_frac": 0.01 * step,
        "clip/frac": 0.02 * step,
        "nav/vetoed_frac": 0.0,
        "veto/catastrophic_seqs": float(step % 2),
        "data/trajectories": 16.0,
        "loss/total": -0.1 * step,
        "mismatch/k3_kl": 0.001 * step,
    }
    for step in range(1, 6)
]


def write_metrics(path: Path, rows: list[dict[str, float]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def invoke(tmp_path: Path, *args: str, **config: object) -> object:
    toml = tmp_path / "rollstream.toml"
    toml.write_text(to_toml({"run_id": "run-a", "state_dir": str(tmp_path / "state"), **config}))
    return CliRunner().invoke(main, ["--config", str(toml), *args])


def embedded_series(html: str) -> dict:
    match = re.search(
        r'<script type="application/json" id="rollstream-series">(.*?)</script>', html, re.S
    )
    assert match
    return orjson.loads(match.group(1).replace("<\\/", "</"))


def test_report_writes_png_and_html_with_the_series(tmp_path: Path) -> None:
    # A restart re-ran step 3 after a checkpoint: the later line is the one that counts.
    restarted = dict(STEPS[2], **{"reward/mean": 0.99})
    metrics = write_metrics(tmp_path / "m.jsonl", [*STEPS[:3], STEPS[2], *STEPS[3:]])
    metrics.write_bytes(metrics.read_bytes() + orjson.dumps(restarted) + b"\n")
    out = tmp_path / "report"
    result = invoke(tmp_path, "report", "run-a", "--metrics", str(metrics), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "5 steps" in result.output

    png = (out / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = imread(out / "report.png")
    assert image.shape[0] > 1000 and image.shape[1] > 800  # five panels, one under another

    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "run-a" in html
    # self-contained: the PNG is inline, byte for byte
    inline = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert inline and base64.b64decode(inline.group(1)) == png
    assert "<link" not in html and "<script src" not in html

    series = embedded_series(html)["series"]
    steps = [1.0, 2.0, 3.0, 4.0, 5.0]
    expected_reward = [0.1, 0.2, 0.99, 0.4, 0.5]
    assert series["reward/mean"]["step"] == steps
    assert series["reward/mean"]["value"] == pytest.approx(expected_reward)
    assert series["staleness/max"]["value"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert series["clip/frac"]["value"] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])
    assert series["mis/masked_frac"]["value"] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert series["nav/vetoed_frac"]["value"] == [0.0] * 5
    assert series["veto/catastrophic_frac"]["value"] == pytest.approx(
        [1 / 16, 0, 1 / 16, 0, 1 / 16]
    )
    assert series["staleness/region/eu"]["value"] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25])
    assert series["staleness/region/us"]["value"] == [1.5] * 5
    assert "tis/truncated_frac" not in series  # not recorded by this run: left out
    # the per-step table holds the values too, with wall-clock times
    assert "<td>0.99</td>" in html and "<th>staleness/region/eu</th>" in html
    assert "<th>time (UTC)</th>" in html


def test_report_finds_the_metrics_of_a_run(tmp_path: Path) -> None:
    default = tmp_path / "state" / "trainer" / "run-b" / "metrics.jsonl"
    write_metrics(default, STEPS[:2])
    result = invoke(tmp_path, "report", "run-b", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert embedded_series((tmp_path / "b" / "report.html").read_text())["run"] == "run-b"

    configured = write_metrics(tmp_path / "elsewhere.jsonl", STEPS[:3])
    result = invoke(
        tmp_path,
        "report",
        "run-a",
        "--out",
        str(tmp_path / "a"),
        trainer={"metrics_file": str(configured)},
    )
    assert result.exit_code == 0, result.output
    series = embedded_series((tmp_path / "a" / "report.html").read_text())["series"]
    assert series["reward/mean"]["step"] == [1.0, 2.0, 3.0]

    missing = invoke(tmp_path, "report", "run-c")
    assert missing.exit_code != 0
    assert "no metrics for run 'run-c'" in missing.output
    assert str(tmp_path / "state" / "trainer" / "run-c" / "metrics.jsonl") in missing.output
