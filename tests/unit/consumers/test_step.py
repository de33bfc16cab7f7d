"""The trainer without Kafka: config, batching, layout, DeepSpeed steps, anchors, metrics.

DeepSpeed runs on the CPU here (gloo, world size 1); every engine trains the tiny Llama
on hand-made scored groups (``support.synthetic``).
"""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from support.synthetic import synthetic_groups

from consumers.batching import BatchAssembler, ConsumedGroup, pack, response_logprobs
from consumers.config import TrainerConfig
from consumers.metrics import MetricsSink, data_metrics, staleness_bucket
from consumers.step import StepRunner, anchored_inputs, step_metrics
from consumers.train_engine import TrainEngine, deepspeed_config
from core.logprobs import response_logprobs as shared_logprobs
from core.models import build_tiny_llama, load_model
from schemas.trajectory import OldLogitsStatus
from weights import format as fmt


def make_config(**sections: object) -> TrainerConfig:
    data = {"engine": {"lr": 1e-3, "zero_stage": 1}, **sections}
    return TrainerConfig.model_validate(data)


def make_runner(config: TrainerConfig) -> tuple[TrainEngine, StepRunner]:
    model = load_model(config.model.spec)
    engine = TrainEngine(
        model, config.engine, frozen_copies=StepRunner.frozen_copies_needed(config)
    )
    return engine, StepRunner(engine, config, pad_id=0)


def flat(groups: list[list]) -> list:
    return [t for g in groups for t in g]


# --- config --------------------------------------------------------------------------


def test_config_defaults_and_strictness() -> None:
    config = TrainerConfig()
    assert config.loss.type == "grpo"
    assert config.engine.zero_stage == 1
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"engine": {"zero_stag": 2}})
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"loss": {"type": "ppo_ewma"}, "approx": {"route": "drop"}})
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"engine": {"accelerator": "cpu", "zero_stage": 3}})
    with pytest.raises(ValidationError):
        config.batch.max_groups = 3  # type: ignore[misc]


def test_config_every_field_is_described() -> None:
    from pydantic import BaseModel

    def walk(model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation)

    walk(TrainerConfig)


def test_config_from_toml_section() -> None:
    text = """
    [trainer]
    max_steps = 5
    [trainer.engine]
    zero_stage = 2
    grad_accum_steps = 2
    [trainer.loss]
    type = "decoupled"
    correction = "tis"
    token_bounds = [0.5, 2.0]
    [trainer.approx]
    route = "infer"
    """
    config = TrainerConfig.model_validate(tomllib.loads(text)["trainer"])
    assert config.loss.type == "decoupled" and config.loss.correction == "tis"
    assert config.needs_old_logp()
    ds = deepspeed_config(config.engine)
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 1.0


def test_deepspeed_overrides_merge() -> None:
    config = make_config(engine={"deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000}}})
    ds = deepspeed_config(config.engine)
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}


# --- batching ------------------------------------------------------------------------


def consumed(offset: int, tokens_per_sample: int = 10, partition: int = 0) -> ConsumedGroup:
    (group,) = synthetic_groups(
        1,
        group_size=2,
        prompt_len=4,
        response_len=tokens_per_sample - 4,
        seed=offset,
        vary_lengths=False,
    )
    return ConsumedGroup("t", partition, offset, group[0].group_id, tuple(group))


def test_assembler_closes_on_group_count_and_tracks_offsets() -> None:
    assembler = BatchAssembler(max_groups=2, max_tokens=None, max_wait_s=60)
    assembler.add_group(consumed(0))
    assembler.add_skipped("t", 1, 7)  # a dead-lettered record still advances its partition
    assert assembler.take() is None
    assembler.add_group(consumed(1))
    batch = assembler.take()
    assert batch is not None and len(batch.groups) == 2 and batch.skipped == 1
    assert batch.next_offsets == {("t", 0): 2, ("t", 1): 8}
    assert assembler.take() is None


def test_assembler_token_budget_never_splits_a_group() -> None:
    assembler = BatchAssembler(max_groups=10, max_tokens=50, max_wait_s=60)
    assembler.add_group(consumed(0))  # 20 tokens
    assembler.add_group(consumed(1))  # 40
    assembler.add_group(consumed(2))  # would be 60 > 50: closes the first two
    first = assembler.take()
    assert first is not None and [g.offset for g in first.groups] == [0, 1]
    big = consumed(3, tokens_per_sample=40)  # 80 tokens alone: over budget, trained alone
    assembler.add_group(big)
    second, third = assembler.take(), assembler.take()
    assert second is not None and [g.offset for g in second.groups] == [2]
    assert third is not None and [g.offset for g in third.groups] == [3]


def test_assembler_max_wait_closes_a_partial_batch() -> None:
    now = [100.0]
    assembler = BatchAssembler(max_groups=8, max_tokens=None, max_wait_s=5, clock=lambda: now[0])
    assert assembler.seconds_left() is None  # nothing to wait for: keep polling
    assembler.add_group(consumed(0))
    now[0] += 4.0
    assert assembler.take() is None and assembler.seconds_left() == pytest.approx(1.0)
    now[0] += 1.0
    batch = assembler.take()
    assert batch is not None and len(batch.groups) == 1


# --- layout --------------------------------------------------------------------------


def test_logp_new_matches_the_shared_layout_and_carries_grad() -> None:
    model = build_tiny_llama(seed=3)
    groups = synthetic_groups(3, model=model, seed=4)
    records = flat(groups)
    batch = pack(records)
    logp = response_logprobs(model, batch)
    expected = shared_logprobs(model, [(t.prompt_ids, t.response_ids) for t in records])
    for i, row in enumerate(expected):
        assert torch.equal(logp[i, : len(row)].detach(), torch.from_numpy(row))
        assert not batch.response_mask[i, len(row) :].any()
    # synthetic groups carry the model's own log-probs as logp_infer = logp_old (exact)
    assert torch.equal(batch.logp_old, batch.logp_infer) and bool(batch.old_exact.all())
    logp.sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


# --- DeepSpeed steps -----------------------------------------------------------------


def test_grpo_steps_reduce_the_loss_and_change_the_weights() -> None:
    config = make_config()
    engine, runner = make_runner(config)
    groups = synthetic_groups(6, model=build_tiny_llama(), seed=1)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = []
    for _ in range(6):
        result = runner.train_step([flat(groups)])
        losses.append(result.metrics["loss/total"])
    assert losses[-1] < losses[0]
    assert result.metrics["grad/norm"] > 0
    assert engine.global_steps == 6
    after = engine.state_dict()
    assert after["model.embed_tokens.weight"].dtype == torch.bfloat16
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    assert changed > 0


@pytest.mark.parametrize("stage", [0, 2])
def test_zero_stages_and_gradient_accumulation(stage: int) -> None:
    config = make_config(engine={"lr": 1e-3, "zero_stage": stage, "grad_accum_steps": 2})
    engine, runner = make_runner(config)
    groups = synthetic_groups(4, model=build_tiny_llama(), seed=2)
    result = runner.train_step([flat(groups[:2]), flat(groups[2:])])
    assert engine.global_steps == 1
    assert result.metrics["tokens/response"] == sum(t.num_response_tokens for t in flat(groups))
    with pytest.raises(ValueError, match="micro-batches"):
        runner.train_step([flat(groups)])


def test_decoupled_with_missing_old_logits_uses_the_ewma_route() -> None:
    config = make_config(loss={"type": "decoupled"}, approx={"route": "ewma", "beta": 0.5})
    _engine, runner = make_runner(config)
    model = build_tiny_llama()
    exact = flat(synthetic_groups(2, model=model, seed=5))
    missing = flat(synthetic_groups(2, model=model, seed=6, status="missing"))
    assert all(t.logp_old is None for t in missing)
    first = runner.train_step([exact + missing])
    assert runner.ewma is not None and runner.ewma.num_updates == 1
    share = sum(t.num_response_tokens for t in missing) / first.metrics["tokens/response"]
    assert first.metrics["data/anchor_prox_frac"] == pytest.approx(share)
    assert first.metrics["mismatch/k3_kl"] >= 0  # over exact records only
    assert first.metrics["data/exact_old_frac"] == pytest.approx(1 - share)
    # the proximal model follows θ_prox: W' = βW + 1 after each step
    runner.train_step([exact + missing])
    assert runner.ewma.weight == pytest.approx(0.5 * 1.5 + 1)
    prox = runner.prox_model.state_dict()
    for name, value in runner.ewma.proximal_state_dict().items():
        assert torch.equal(prox[name], value)
    # the EWMA travels with a checkpoint's client state
    saved = runner.state_dict()
    runner.load_state_dict(saved)
    assert runner.ewma.weight == pytest.approx(1.75)


def test_ppo_ewma_reset_when_kept_fraction_falls() -> None:
    config = make_config(
        loss={
            "type": "ppo_ewma",
            "beta": 0.9,
            "reset_below": 1.0,
            "reset_rule": "below",
            "token_bounds": [0.999, 1.001],
        },
        approx={"exact_for_ppo_ewma": False},
    )
    _engine, runner = make_runner(config)
    records = flat(synthetic_groups(3, seed=7))  # random logp_infer: far from the model
    result = runner.train_step([records])
    assert result.metrics["train_infer/kept_frac"] < 1.0
    assert result.metrics["ewma/reset"] == 1.0 and runner.ewma is not None
    assert runner.ewma.num_resets == 1 and runner.ewma.weight == 1.0
    assert result.metrics["data/anchor_prox_frac"] == 1.0


def test_route_drop_skips_records_without_exact_old_logits() -> None:
    config = make_config(loss={"type": "decoupled"}, approx={"route": "drop"})
    _engine, runner = make_runner(config)
    model = build_tiny_llama()
    exact = flat(synthetic_groups(1, model=model, seed=8))
    approx = flat(synthetic_groups(1, model=model, seed=9, status=OldLogitsStatus.OFF.value))
    result = runner.train_step([exact + approx])
    assert result.dropped == len(approx)
    assert [t.trajectory_id for t in result.trained] == [t.trajectory_id for t in exact]


def test_route_current_anchors_lost_old_logits_on_the_weights_being_trained() -> None:
    """The lost-old-logits baseline: records without exact logp_old are anchored on the
    detached log-probs of the policy being trained (s = 1); exact records keep logp_old."""
    config = make_config(loss={"type": "decoupled"}, approx={"route": "current"})
    model = build_tiny_llama(seed=3)
    exact = flat(synthetic_groups(1, model=model, seed=10))
    lost = flat(synthetic_groups(1, model=model, seed=11, status=OldLogitsStatus.OFF.value))
    batch = pack(exact + lost)
    logp_new = response_logprobs(build_tiny_llama(seed=4), batch)
    inputs, on_prox = anchored_inputs(config, batch, logp_new)
    assert on_prox is None and inputs.logp_old is not None
    assert not inputs.logp_old.requires_grad
    n = len(exact)
    assert torch.equal(inputs.logp_old[:n], batch.logp_old[:n])
    assert torch.equal(inputs.logp_old[n:], logp_new.detach()[n:])
    # a step trains them: s = 1 on the lost records, d = pi_theta / pi_infer masks or not
    _engine, runner = make_runner(config)
    result = runner.train_step([exact + lost])
    assert len(result.trained) == len(exact + lost) and result.dropped == 0
    assert result.metrics["data/exact_old_frac"] < 1.0


def test_mismatch_abs_log_d_is_reported_over_exact_records() -> None:
    records = flat(synthetic_groups(2, seed=12))  # random logp_infer beside exact logp_old
    batch = pack(records)
    metrics = step_metrics({}, batch, None)
    log_d = (batch.logp_old - batch.logp_infer).abs()[batch.loss_mask]
    assert metrics["mismatch/abs_log_d/mean"] == pytest.approx(float(log_d.mean()), rel=1e-5)
    assert metrics["mismatch/abs_log_d/max"] == pytest.approx(float(log_d.max()), rel=1e-5)
    lost = flat(synthetic_groups(1, seed=13, status=OldLogitsStatus.OFF.value))
    assert "mismatch/abs_log_d/mean" not in step_metrics({}, pack(lost), None)


def test_approx_route_garbage_is_refused() -> None:
    for route in ("currnet", "", 3, None):
        with pytest.raises(ValidationError, match="route"):
            TrainerConfig.model_validate({"approx": {"route": route}})


def test_kl_reference_and_mu_grpo() -> None:
    config = make_config(loss={"type": "mu_grpo", "kl_coef": 0.1})
    _engine, runner = make_runner(config)
    assert runner.ref_model is not None
    records = flat(synthetic_groups(2, model=build_tiny_llama(), seed=10))
    first = runner.train_step([records])
    second = runner.train_step([records])
    assert first.metrics["kl/ref_k3"] == pytest.approx(0.0, abs=1e-3)  # bf16 vs fp32 copy
    assert second.metrics["kl/ref_k3"] > first.metrics["kl/ref_k3"]
    assert "nav/vetoed_frac" in second.metrics


# --- metrics -------------------------------------------------------------------------


def test_data_metrics_staleness_histogram_and_regions() -> None:
    groups = synthetic_groups(1, group_size=2, seed=11, version=3, region="eu")
    groups += synthetic_groups(1, group_size=1, seed=12, version=0, region="us")
    metrics = data_metrics(flat(groups), version=5)
    assert metrics["staleness/hist/2"] == 2.0 and metrics["staleness/hist/4-7"] == 1.0
    assert metrics["staleness/region/eu"] == 2.0 and metrics["staleness/region/us"] == 5.0
    assert metrics["staleness/max"] == 5.0
    assert metrics["data/groups"] == 2.0 and metrics["data/trajectories"] == 3.0
    assert [staleness_bucket(s) for s in (0, 3, 9, 40, -1)] == ["0", "3", "8-15", "16+", "0"]


def test_data_metrics_report_the_share_of_each_reward_flag() -> None:
    records = flat(synthetic_groups(1, group_size=4, seed=14, version=1))
    details = [
        {"correct": True, "format_ok": True, "parsed": 7},
        {"correct": False, "format_ok": True, "parsed": None},
        {"correct": False, "format_ok": "yes"},  # not a flag: not counted
        {},
    ]
    records = [
        dataclasses.replace(t, reward_details=d) for t, d in zip(records, details, strict=True)
    ]
    metrics = data_metrics(records, version=1)
    assert metrics["reward/correct_frac"] == pytest.approx(1 / 3)
    assert metrics["reward/format_ok_frac"] == 1.0
    assert not [k for k in metrics if k.startswith("reward/parsed")]
    many = flat(synthetic_groups(1, group_size=2, seed=15, version=1))
    many[0] = dataclasses.replace(many[0], reward_details={f"flag{i}": True for i in range(40)})
    flags = [k for k in data_metrics(many, version=1) if k.endswith("_frac")]
    assert len(flags) == 16


def test_metrics_sink_writes_jsonl_and_prometheus(tmp_path) -> None:
    import orjson

    path = tmp_path / "m" / "metrics.jsonl"
    sink = MetricsSink(path)
    records = flat(synthetic_groups(1, group_size=2, seed=13, version=1))
    row = {"step": 1.0, "version": 2.0, "loss/total": 0.5, "bad": float("nan")}
    row |= {"lag/partition/3": 7.0, "episode/end/max_turns": 2.0}
    sink.emit(row, records)
    sink.record_dlq("bad_magic")
    sink.close()
    (line,) = path.read_bytes().splitlines()
    assert orjson.loads(line) == {k: v for k, v in row.items() if k != "bad"}
    value = sink.registry.get_sample_value
    # one gauge per metric; a family whose last part is data has it as a label
    assert value("rollstream_trainer_loss_total") == 0.5
    assert value("rollstream_trainer_version") == 2.0
    assert value("rollstream_trainer_bad") is None  # not finite: not set
    assert value("rollstream_trainer_lag_partition", {"partition": "3"}) == 7.0
    assert value("rollstream_trainer_episode_end", {"reason": "max_turns"}) == 2.0
    assert value("rollstream_trainer_trajectories_total") == 2.0
    assert value("rollstream_trainer_dlq_records_total", {"reason": "bad_magic"}) == 1.0
    assert value("rollstream_trainer_staleness_count") == 2.0
    assert np.isclose(value("rollstream_trainer_staleness_sum"), 2.0)


# --- PPO epochs and minibatches ------------------------------------------------------


def test_minibatch_plan_covers_every_record_once_per_epoch() -> None:
    from consumers.step import minibatch_plan

    records = flat(synthetic_groups(5, seed=11))  # 20 records
    plan = minibatch_plan(
        records, epochs=3, minibatches=4, grad_accum_steps=2, shuffle=True, seed=7
    )
    assert len(plan) == 12 and all(len(mb) == 2 and all(mb) for mb in plan)
    ids = sorted(t.trajectory_id for t in records)
    for epoch in range(3):
        seen = [t.trajectory_id for mb in plan[epoch * 4 : epoch * 4 + 4] for m in mb for t in m]
        assert sorted(seen) == ids
    again = minibatch_plan(records, 3, 4, 2, True, seed=7)
    assert [[t.trajectory_id for m in mb for t in m] for mb in again] == [
        [t.trajectory_id for m in mb for t in m] for mb in plan
    ]
    # too few records for 4 minibatches of 2 micro-batches: fewer minibatches, none empty
    few = minibatch_plan(
        records[:5], epochs=1, minibatches=4, grad_accum_steps=2, shuffle=False, seed=0
    )
    assert len(few) == 2 and all(len(mb) == 2 and all(mb) for mb in few)


def test_ppo_epochs_make_the_clip_a_trust_region_on_policy() -> None:
    """At staleness 0, one optimiser step per batch has ratio 1 and never clips; several
    steps per batch move the policy within the batch, so the clip acts."""
    groups = synthetic_groups(4, model=build_tiny_llama(), seed=12, vary_lengths=False)
    engine_cfg = {"lr": 3e-2, "zero_stage": 1, "bf16": False}
    single = make_config(engine=engine_cfg, loss={"type": "decoupled"})
    _engine, runner = make_runner(single)
    one = runner.train_step([flat(groups)])
    assert one.metrics["ppo/optimizer_steps"] == 1.0
    assert one.metrics["ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert one.metrics["clip/frac"] == 0.0

    several = make_config(
        engine=engine_cfg, loss={"type": "decoupled"}, ppo={"epochs": 2, "minibatches": 2}
    )
    engine, runner = make_runner(several)
    result = runner.train_step([flat(groups)], step=3)
    assert result.metrics["ppo/optimizer_steps"] == 4.0 and engine.global_steps == 4
    assert result.metrics["clip/frac"] > 0.0
    assert result.metrics["ratio/max"] > 1.2
    # every record counts once, whatever the number of passes
    assert result.metrics["tokens/response"] == sum(t.num_response_tokens for t in flat(groups))
    assert len(result.trained) == len(flat(groups))


def test_ppo_config_garbage_is_refused() -> None:
    for bad in (
        {"epochs": 0},
        {"minibatches": -1},
        {"epochs": "two"},
        {"shuffle": "maybe"},
        {"epoch": 2},
    ):
        with pytest.raises(ValidationError):
            TrainerConfig.model_validate({"ppo": bad})
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({"approx": {"reset_rule": "sometimes"}})


@pytest.mark.parametrize("stage", [0, 1])
def test_fp32_training_with_bf16_versions_trains_the_shipped_copy(stage: int) -> None:
    """``publish.dtype = "bfloat16"`` with fp32 training: the forward passes run on the
    bf16 copy of the master weights, so at staleness 0 the ratio against the copy's
    log-probs (what the stream computes for the version) is 1 and nothing clips, where a
    trainer on its master weights is off by their rounding; the master weights keep
    updates smaller than a bf16 step, which the copy does not show."""
    groups = synthetic_groups(4, model=build_tiny_llama(), seed=12, vary_lengths=False)
    engine_cfg = {"lr": 1e-3, "zero_stage": stage, "bf16": False}
    ratios = {}
    for dtype in ("bfloat16", "trainer"):
        config = make_config(
            engine=engine_cfg, loss={"type": "decoupled"}, publish={"dtype": dtype}
        )
        assert config.trains_on_shipped_copy() == (dtype == "bfloat16")
        engine, runner = make_runner(config)
        runner.train_step([flat(groups)])  # the master moves off the bf16 grid
        master = {k: v.clone() for k, v in engine.state_dict().items()}
        assert all(v.dtype == torch.float32 for v in master.values())
        shipped = build_tiny_llama()
        shipped.load_state_dict(fmt.cast_state(master, torch.bfloat16))
        fresh = synthetic_groups(4, model=shipped, seed=13, vary_lengths=False)  # logp_old: v1's
        ratios[dtype] = runner.train_step([flat(fresh)]).metrics
    on_copy, on_master = ratios["bfloat16"], ratios["trainer"]
    assert on_copy["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert on_copy["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(on_master["ratio/max"] - 1.0) > 1e-3

    # a step far below a bf16 rounding step moves nearly every master weight, while the
    # shipped copy changes only where a weight sat next to a rounding boundary
    config = make_config(engine={**engine_cfg, "lr": 1e-7}, publish={"dtype": "bfloat16"})
    engine, runner = make_runner(config)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    runner.train_step([flat(groups)])
    after = engine.state_dict()
    copy_before = fmt.cast_state(before, torch.bfloat16)
    copy_after = fmt.cast_state(after, torch.bfloat16)
    elements = sum(t.numel() for t in before.values())
    moved = sum(int((after[k] != before[k]).sum()) for k in before) / elements
    shown = sum(int((copy_after[k] != copy_before[k]).sum()) for k in before) / elements
    assert moved > 0.9 and shown < 0.02, (moved, shown)


def test_bf16_versions_of_fp32_weights_refuse_zero_3() -> None:
    with pytest.raises(ValidationError, match="zero_stage <= 2"):
        make_config(
            engine={"accelerator": "cuda", "zero_stage": 3, "bf16": False},
            publish={"dtype": "bfloat16"},
        )
    make_config(engine={"accelerator": "cuda", "zero_stage": 3}, publish={"dtype": "bfloat16"})
