"""The learning benchmark's cell: forced staleness and every route runs (a few steps)."""

from __future__ import annotations

import pytest

from bench.learning import ROUTES, Settings, run_cell, table

SHORT = Settings(steps=4, prompts_per_step=2, group_size=4)


def test_every_batch_is_exactly_k_versions_old() -> None:
    cell = run_cell(ROUTES[2], staleness=2, seed=0, settings=SHORT)
    assert cell.versions == [0, 0, 0, 1]  # step n trains on version n - 2 once it exists
    assert len(cell.rewards) == 4 and all(0.0 <= r <= 1.0 for r in cell.rewards)
    assert cell.cpu_s == sorted(cell.cpu_s)


@pytest.mark.parametrize("route", ROUTES, ids=[r.name for r in ROUTES])
def test_every_route_trains(route) -> None:
    cell = run_cell(
        route, staleness=1, seed=1, settings=Settings(steps=2, prompts_per_step=2, group_size=4)
    )
    assert len(cell.clip_frac) == 2
    assert all(0.0 <= m <= 1.0 for m in cell.mask_frac)
    assert "| 1 | " + route.name + " |" in table([cell], SHORT)


def test_dynamic_sampling_cells_train_no_zero_advantage_group() -> None:
    settings = Settings(
        steps=3, prompts_per_step=4, group_size=4, operators=({"name": "zero_variance"},)
    )
    cell = run_cell(ROUTES[2], staleness=0, seed=3, settings=settings)
    assert cell.zero_adv and all(share == 0.0 for share in cell.zero_adv)
    assert all(g >= 4 for g in cell.generated) and len(cell.generated_flat) == 3
