"""PPO-EWMA proximal weights: update and reset pinned to hand-computed values."""

from __future__ import annotations

import io
import math

import pytest
import torch

from consumers.ewma import EwmaProximal, should_reset


def state(*values: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=dtype)}


def prox(ewma: EwmaProximal) -> list[float]:
    return ewma.proximal_state_dict()["w"].tolist()


def approx(actual: list[float], expected: list[float], tol: float = 1e-6) -> bool:
    return all(abs(a - e) <= tol for a, e in zip(actual, expected, strict=True))


def test_update_values() -> None:
    # beta = 0.5, start theta_0 = [0, 0] with W = 1.
    ewma = EwmaProximal(state(0.0, 0.0), beta=0.5)
    # theta_1 = [2, 4]: W' = 0.5*1 + 1 = 1.5; prox = (0.5/1.5)*[0, 0] + [2, 4]/1.5
    ewma.update(state(2.0, 4.0))
    assert ewma.weight == 1.5
    assert approx(prox(ewma), [4 / 3, 8 / 3])
    # theta_2 = [4, -2]: W'' = 0.5*1.5 + 1 = 1.75
    # prox = (0.75/1.75)*[4/3, 8/3] + [4, -2]/1.75 = [20/7, 0]
    # check: weights 1, 0.5, 0.25 on theta_2, theta_1, theta_0: (4 + 1 + 0) / 1.75 = 20/7,
    #        (-2 + 2 + 0) / 1.75 = 0
    ewma.update(state(4.0, -2.0))
    assert ewma.weight == 1.75
    assert approx(prox(ewma), [20 / 7, 0.0])
    assert ewma.num_updates == 2


def test_beta_zero_follows_current_weights() -> None:
    ewma = EwmaProximal(state(1.0, 1.0), beta=0.0)
    ewma.update(state(3.0, -5.0))
    assert prox(ewma) == [3.0, -5.0]


def test_reset_restarts_the_average() -> None:
    ewma = EwmaProximal(state(0.0, 0.0), beta=0.5)
    ewma.update(state(2.0, 4.0))
    ewma.update(state(4.0, -2.0))
    ewma.reset(state(1.0, 1.0))
    assert prox(ewma) == [1.0, 1.0]
    assert ewma.weight == 1.0 and ewma.num_resets == 1
    # after the reset only [1, 1] is remembered: W' = 1.5,
    # prox = (0.5/1.5)*[1, 1] + [4, -2]/1.5 = [3, -1]
    ewma.update(state(4.0, -2.0))
    assert approx(prox(ewma), [3.0, -1.0])


def test_bf16_weights_accumulate_in_float32() -> None:
    ewma = EwmaProximal(state(1.0, -2.0, dtype=torch.bfloat16), beta=0.5)
    ewma.update(state(2.0, 0.0, dtype=torch.bfloat16))
    # prox = (1/3)*[1, -2] + (2/3)*[2, 0] = [5/3, -2/3], kept in float32;
    # a bf16 accumulator would hold 1.6640625.
    params = ewma.state_dict()["params"]["w"]
    assert params.dtype == torch.float32
    assert approx(params.tolist(), [5 / 3, -2 / 3], tol=1e-6)
    out = ewma.proximal_state_dict()["w"]
    assert out.dtype == torch.bfloat16
    assert out.tolist() == torch.tensor([5 / 3, -2 / 3]).to(torch.bfloat16).tolist()


def test_copy_does_not_alias_the_source() -> None:
    source = state(1.0, 2.0)
    ewma = EwmaProximal(source, beta=0.5)
    source["w"].add_(10.0)
    assert prox(ewma) == [1.0, 2.0]
    ewma.reset(source)
    source["w"].zero_()
    assert prox(ewma) == [11.0, 12.0]


def test_integer_buffers_take_the_latest_value() -> None:
    ewma = EwmaProximal({"w": torch.zeros(2), "steps": torch.tensor(3)}, beta=0.5)
    ewma.update({"w": torch.ones(2), "steps": torch.tensor(7)})
    out = ewma.proximal_state_dict()
    assert out["steps"].item() == 7 and out["steps"].dtype == torch.int64
    assert approx(out["w"].tolist(), [2 / 3, 2 / 3])


def test_module_state_dict_round_trip_through_load() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ewma = EwmaProximal(model.state_dict(), beta=0.75)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ewma.update(model.state_dict())
    copy = torch.nn.Linear(2, 2)
    copy.load_state_dict(ewma.proximal_state_dict())
    # W' = 1.75; prox = (0.75/1.75)*theta_0 + (theta_0 + 1)/1.75 = theta_0 + 1/1.75
    assert torch.allclose(copy.weight, before["weight"] + 1 / 1.75, atol=1e-6)
    assert torch.allclose(copy.bias, before["bias"], atol=1e-6)


def test_checkpoint_round_trip() -> None:
    a = EwmaProximal(state(0.0, 0.0), beta=0.5)
    a.update(state(2.0, 4.0))
    a.reset(state(1.0, 1.0))
    a.update(state(3.0, 3.0))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = EwmaProximal(state(9.0, 9.0), beta=0.5)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    assert (b.weight, b.num_updates, b.num_resets) == (a.weight, a.num_updates, a.num_resets)
    assert prox(b) == prox(a)
    a.update(state(-1.0, 5.0))
    b.update(state(-1.0, 5.0))
    assert prox(b) == prox(a)
    # the restored copy is independent of the checkpoint dict
    assert a.state_dict()["params"]["w"].data_ptr() != b.state_dict()["params"]["w"].data_ptr()


def test_mismatches_are_errors() -> None:
    ewma = EwmaProximal(state(0.0, 0.0), beta=0.5)
    with pytest.raises(KeyError):
        ewma.update({"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        ewma.update(state(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="beta"):
        EwmaProximal(state(0.0), beta=0.3).load_state_dict(
            EwmaProximal(state(0.0), beta=0.5).state_dict()
        )
    with pytest.raises(ValueError, match="beta"):
        EwmaProximal(state(0.0), beta=1.0)


def test_should_reset() -> None:
    assert should_reset(0.79, 0.8)
    assert not should_reset(0.8, 0.8)  # strictly below
    assert not should_reset(0.1, None)  # disabled
    assert EwmaProximal.should_reset(0.5, 0.6)
    for bad in (math.nan, -0.1, 1.5):
        with pytest.raises(ValueError):
            should_reset(bad, 0.8)


def test_drop_rule_resets_on_a_fall_not_on_a_steady_tight_band() -> None:
    state = {"w": torch.zeros(2)}
    below, drop = EwmaProximal(state, 0.5), EwmaProximal(state, 0.5)
    # a tight MIS band keeps ~30% of tokens at every step
    steady = [0.31, 0.29, 0.30, 0.32, 0.30, 0.28]
    assert all(below.observe_kept(k, 0.8, "below") for k in steady)
    assert not any(drop.observe_kept(k, 0.8, "drop") for k in steady)
    # then a sudden fall to a third of that level
    assert drop.observe_kept(0.1, 0.8, "drop")
    # near a kept fraction of 1 the rules agree
    wide_below, wide_drop = EwmaProximal(state, 0.5), EwmaProximal(state, 0.5)
    for k in [1.0, 0.99, 1.0, 0.7, 1.0]:
        assert wide_below.observe_kept(k, 0.8, "below") == wide_drop.observe_kept(k, 0.8, "drop")
    assert drop.observe_kept(0.3, None, "drop") is False
    with pytest.raises(ValueError, match="reset rule"):
        drop.observe_kept(0.5, 0.8, "never")
    with pytest.raises(ValueError):
        drop.observe_kept(float("nan"), 0.8, "drop")


def test_running_kept_level_travels_with_the_state_dict() -> None:
    state = {"w": torch.zeros(2)}
    ewma = EwmaProximal(state, 0.5)
    for k in [0.3, 0.35, 0.3]:
        ewma.observe_kept(k, 0.8, "drop")
    restored = EwmaProximal(state, 0.5)
    restored.load_state_dict(ewma.state_dict())
    assert restored.kept_level == ewma.kept_level
    legacy = ewma.state_dict()
    del legacy["kept_level"]  # a checkpoint written before the drop rule
    restored.load_state_dict(legacy)
    assert restored.kept_level is None
