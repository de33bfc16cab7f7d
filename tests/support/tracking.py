"""Read tracked metrics back with each tool's own reader."""

from __future__ import annotations

from pathlib import Path


def tensorboard_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def mlflow_history(uri: str, project: str, run: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == [run]  # resumed, never a second run
    return sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key))
