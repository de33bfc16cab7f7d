"""Stream data operators: each built-in's contract, the chain, config errors, user operators."""

from __future__ import annotations

import dataclasses

import pytest
from support.streams import synthetic

from schemas.trajectory import FinishReason
from streams.operators import (
    BUILTINS,
    Drop,
    Keep,
    OperatorError,
    apply_chain,
    build_chain,
    build_operator,
)


def group(rewards, **kw):  # type: ignore[no-untyped-def]
    return tuple(
        synthetic(group_size=len(rewards), sample_index=i, reward=r, seed=i, **kw)
        for i, r in enumerate(rewards)
    )


def test_builtins_are_registered_by_name() -> None:
    assert set(BUILTINS) == {
        "zero_variance",
        "overlong",
        "length_penalty",
        "duplicate_responses",
        "reward_clip",
    }


def test_zero_variance_drops_equal_rewards_and_keeps_others() -> None:
    op = build_operator("zero_variance")
    assert op(group([1.0, 1.0, 1.0])) == Drop("zero_variance")
    g = group([1.0, 0.0, 1.0])
    assert op(g) == Keep(g)


def test_overlong_filters_or_penalises_truncated_samples() -> None:
    g = group([1.0, 1.0, 0.0])
    g = (dataclasses.replace(g[0], finish_reason=FinishReason.LENGTH.value), *g[1:])
    kept = build_operator("overlong")(g)
    assert isinstance(kept, Keep) and [t.sample_index for t in kept.samples] == [1, 2]
    pen = build_operator("overlong", {"mode": "penalise", "penalty": -1.0})(g)
    assert isinstance(pen, Keep) and [t.reward for t in pen.samples] == [-1.0, 1.0, 0.0]
    all_long = tuple(dataclasses.replace(t, finish_reason="length") for t in g)
    assert build_operator("overlong")(all_long) == Drop("overlong")


def test_length_penalty_and_reward_clip_reshape_rewards() -> None:
    g = group([1.0, 5.0, -5.0], response_len=10)
    out = build_operator("length_penalty", {"coef": 0.1, "free_tokens": 4})(g)
    assert isinstance(out, Keep)
    assert [round(t.reward, 6) for t in out.samples] == [0.4, 4.4, -5.6]
    out = build_operator("reward_clip", {"low": -1, "high": 1})(g)
    assert isinstance(out, Keep) and [t.reward for t in out.samples] == [1.0, 1.0, -1.0]


def test_duplicate_responses_keep_the_first() -> None:
    g = group([1.0, 0.0, 1.0])
    g = (g[0], dataclasses.replace(g[1], response_ids=g[0].response_ids.copy()), g[2])
    out = build_operator("duplicate_responses")(g)
    assert isinstance(out, Keep) and [t.sample_index for t in out.samples] == [0, 2]


def test_chain_traces_each_decision_and_stops_at_a_drop() -> None:
    chain = build_chain(
        [
            {"name": "reward_clip", "options": {"low": 0, "high": 1}},
            {"name": "zero_variance"},
            {"name": "duplicate_responses"},
        ]
    )
    result = apply_chain(chain, group([2.0, 3.0]))
    assert result.decision == Drop("zero_variance") and result.dropped_by == "zero_variance"
    assert result.trace == (("reward_clip", "changed"), ("zero_variance", "zero_variance"))
    g = group([0.0, 1.0])
    result = apply_chain(chain, g)
    assert result.decision == Keep(g) and result.dropped_by is None
    assert [d for _, d in result.trace] == ["kept", "kept", "kept"]


def test_chain_reports_the_samples_an_operator_takes_out() -> None:
    g = group([1.0, 0.0, 1.0])
    g = (g[0], dataclasses.replace(g[1], response_ids=g[0].response_ids.copy()), g[2])
    result = apply_chain(build_chain([{"name": "duplicate_responses"}]), g)
    assert isinstance(result.decision, Keep) and len(result.decision.samples) == 2
    assert [(op, t.sample_index) for op, t in result.removed] == [("duplicate_responses", 1)]
    # an operator that takes every sample out filters the group
    long = tuple(dataclasses.replace(t, finish_reason="length") for t in group([0.0, 1.0]))
    result = apply_chain(build_chain([{"name": "overlong"}]), long)
    assert result.decision == Drop("overlong") and result.removed == ()


def test_empty_chain_keeps_the_group() -> None:
    g = group([1.0, 1.0])
    result = apply_chain(build_chain([]), g)
    assert result.decision == Keep(g) and result.trace == () and result.removed == ()


def test_user_operator_by_dotted_path() -> None:
    chain = build_chain(
        [{"name": "support.user_operators:DropLowMean", "options": {"threshold": 0.6}}]
    )
    assert apply_chain(chain, group([0.0, 1.0])).decision == Drop("low_mean")
    assert isinstance(apply_chain(chain, group([1.0, 0.5])).decision, Keep)


@pytest.mark.parametrize(
    "path", ["support.user_operators:Raises", "support.user_operators:WrongType"]
)
def test_broken_user_operator_raises_operator_error(path: str) -> None:
    with pytest.raises(OperatorError, match="operator"):
        apply_chain(build_chain([{"name": path}]), group([0.0, 1.0]))


@pytest.mark.parametrize(
    "spec",
    [
        [{"name": "no_such_op"}],
        [{"name": "support.user_operators:Missing"}],
        [{"name": "zero_variance", "options": {"bogus": 1}}],
        [{"name": "overlong", "options": {"mode": "sideways"}}],
        [{"options": {}}],
        [{"name": "reward_clip", "extra": 1}],
    ],
)
def test_malformed_operator_config_is_refused(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        build_chain(spec)


def test_filtered_group_header_round_trips_and_refuses_garbage() -> None:
    from schemas.codec import FILTERED_HEADER
    from schemas.control import FilteredGroup

    msg = FilteredGroup(group_id="g", operator="zero_variance", reason="zero_variance")
    assert FilteredGroup.from_headers([msg.header()]) == msg
    with pytest.raises(ValueError):
        FilteredGroup.from_json(b'{"group_id": "g"}')
    with pytest.raises(ValueError):
        FilteredGroup.from_headers([(FILTERED_HEADER, b"not json")])


def test_streams_config_refuses_a_bad_operator_at_load_and_defaults_to_none() -> None:
    from pydantic import ValidationError

    from streams.config import StreamsConfig

    assert StreamsConfig().operators == []
    ok = StreamsConfig.model_validate({"operators": [{"name": "zero_variance"}]})
    assert [o.name for o in ok.operators] == ["zero_variance"]
    with pytest.raises(ValidationError, match="no_such_op"):
        StreamsConfig.model_validate({"operators": [{"name": "no_such_op"}]})
