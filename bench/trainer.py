"""Trainer benchmark: DeepSpeed trainer step vs a plain torch loop, and publish cost.

Run from the repository root: ``python -m bench.trainer [--model SPEC]`` (a model spec of
``core.models``; default ``smollm2-135m-instruct``, ``tiny`` for the tiny model).

1. **Tokens/s.** The trainer's step (``consumers.step.StepRunner`` on a DeepSpeed
   ``TrainEngine``: shared log-prob layout, GRPO loss, backward, clip, AdamW) against a
   plain torch loop doing the same work on the same model and the same batches
   (``response_logprobs`` + ``compute_loss`` + ``backward`` + ``clip_grad_norm_`` +
   ``torch.optim.AdamW``), steps interleaved A/B so both see the same machine load. Two
   pairs with matched numerics: fp32 (DeepSpeed ZeRO-0, bf16 off vs plain fp32) and bf16
   (DeepSpeed ZeRO-1 bf16 with fp32 master weights vs plain fp32 weights under
   ``torch.autocast(bfloat16)``). Tokens/s from the median step time over ``--steps``
   after ``--warmup``; the ratio is the median over steps of the per-pair ratio (the two
   steps of a pair run back to back, in alternating order), which is what survives other
   work on a shared machine. Target: DeepSpeed at least 0.8x the plain loop.
2. **Publish cost.** With ``publish_every = 1``: the trainer's default engine (ZeRO-1,
   bf16) at lr 1e-5, every step followed by ``Publisher.publish`` (state dict → sparse
   bf16 delta → zstd → S3 upload → manifest claim) to a real SeaweedFS started here.
   Reports publish seconds / step seconds (target < 10% for SmolLM2-135M) and the delta
   size. The announcement on Kafka is not included (a ~300-byte message).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from consumers.batching import pack, response_logprobs
from consumers.config import ModelConfig, TrainerConfig
from consumers.losses import LossInputs, compute_loss
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine
from core.models import SMOLLM2, load_model
from schemas.trajectory import Trajectory
from tests.support.synthetic import synthetic_groups

TARGET_RATIO = 0.8
TARGET_PUBLISH_FRACTION = 0.10


def make_batches(
    model_config: Any, n: int, seqs: int, prompt_len: int, response_len: int
) -> list[list[Trajectory]]:
    """``n`` batches of ``seqs`` sequences (groups of 4) with fixed lengths."""
    groups_per_batch = max(seqs // 4, 1)
    batches = []
    for i in range(n):
        groups = synthetic_groups(
            groups_per_batch,
            group_size=4,
            prompt_len=prompt_len,
            response_len=response_len,
            vocab_size=int(model_config.vocab_size),
            seed=100 + i,
            vary_lengths=False,
        )
        batches.append([t for g in groups for t in g])
    return batches


class PlainLoop:
    """The same step with nothing but torch: forward, loss, backward, clip, AdamW."""

    def __init__(self, model_config: ModelConfig, config: TrainerConfig, bf16: bool) -> None:
        torch.manual_seed(config.engine.seed)
        self.model = load_model(model_config.spec).train()
        self.config = config
        self.bf16 = bf16
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.engine.lr, betas=config.engine.betas
        )

    def step(self, records: list[Trajectory]) -> float:
        batch = pack(records)
        autocast = (
            torch.autocast(device_type="cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext()
        )
        with autocast:
            logp = response_logprobs(self.model, batch)
        out = compute_loss(
            self.config.loss,
            LossInputs(
                logp_new=logp,
                logp_infer=batch.logp_infer,
                advantages=batch.advantages,
                mask=batch.loss_mask,
            ),
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.engine.grad_clip or 0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out.metrics["loss/total"]


def timed(fn: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def throughput(
    model_config: ModelConfig, args: argparse.Namespace, batches: list[list[Trajectory]]
) -> list[tuple[str, float, float, float]]:
    """(label, deepspeed tok/s, plain tok/s, ratio) for the fp32 and bf16 pairs."""
    tokens = sum(t.num_prompt_tokens + t.num_response_tokens for t in batches[0])
    rows = []
    for label, bf16, stage in (("fp32", False, 0), ("bf16", True, 1)):
        config = TrainerConfig.model_validate(
            {
                "model": model_config.model_dump(),
                "engine": {"lr": 1e-5, "bf16": bf16, "zero_stage": stage},
            }
        )
        torch.manual_seed(config.engine.seed)
        engine = TrainEngine(load_model(model_config.spec), config.engine)
        runner = StepRunner(engine, config, pad_id=0)
        plain = PlainLoop(model_config, config, bf16)
        ds_times, plain_times, ratios = [], [], []
        for i, records in enumerate(batches):
            if i % 2 == 0:  # alternate the order (A B, B A, ...): neither side goes first
                ds_t = timed(runner.train_step, [records])
                plain_t = timed(plain.step, records)
            else:
                plain_t = timed(plain.step, records)
                ds_t = timed(runner.train_step, [records])
            if i >= args.warmup:
                ds_times.append(ds_t)
                plain_times.append(plain_t)
                ratios.append(plain_t / ds_t)
        ds_tps = tokens / statistics.median(ds_times)
        plain_tps = tokens / statistics.median(plain_times)
        rows.append((label, ds_tps, plain_tps, statistics.median(ratios)))
    return rows


def publish_cost(
    model_config: ModelConfig, args: argparse.Namespace, batches: list[list[Trajectory]]
) -> dict[str, float]:
    from consumers.config import PublishConfig
    from consumers.weight_publisher import Publisher
    from core.config import RetryConfig
    from infra.s3 import SeaweedServer, ensure_bucket
    from weights.store import WeightStore, make_s3_client
    from weights.writer import DeltaWriter

    config = TrainerConfig.model_validate(
        {"model": model_config.model_dump(), "engine": {"lr": 1e-5}}
    )
    engine = TrainEngine(load_model(model_config.spec), config.engine)
    runner = StepRunner(engine, config, pad_id=0)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as scratch:
        server = SeaweedServer(Path(scratch) / "s3")
        server.start()
        try:
            s3 = server.config(bucket="bench-trainer")
            ensure_bucket(make_s3_client(s3), s3.bucket)
            store = WeightStore.from_config(s3, "bench")
            publisher = Publisher(DeltaWriter(store), PublishConfig(), RetryConfig())
            base = timed(lambda: publisher.publish(0, engine.state_dict()))
            step_times, publish_times, sizes = [], [], []
            for i, records in enumerate(batches, start=1):
                step_times.append(timed(runner.train_step, [records]))
                publish_times.append(timed(lambda v=i: publisher.publish(v, engine.state_dict())))
                assert publisher.last is not None
                sizes.append(publisher.last.announcement.bytes)
        finally:
            server.stop()
    from weights import format as fmt

    dense = fmt.dense_bytes(engine.state_dict())  # tied tensors counted once
    skip = min(args.warmup, len(step_times) - 1)
    step_s = statistics.median(step_times[skip:])
    publish_s = statistics.median(publish_times[skip:])
    return {
        "base_s": base,
        "step_s": step_s,
        "publish_s": publish_s,
        "fraction": publish_s / step_s,
        "delta_bytes": statistics.median(sizes[skip:]),
        "dense_bytes": float(dense),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2, help="Model spec (core.models).")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=8, help="sequences per batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--skip-publish", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_config = ModelConfig(spec=args.model)
    probe = load_model(model_config.spec)
    n_params = sum(p.numel() for p in probe.parameters())
    batches = make_batches(
        probe.config, args.warmup + args.steps, args.seqs, args.prompt_len, args.response_len
    )
    del probe
    tokens = sum(t.num_prompt_tokens + t.num_response_tokens for t in batches[0])
    print(
        f"model {args.model} ({n_params / 1e6:.1f}M params), batch {args.seqs} x "
        f"({args.prompt_len}+{args.response_len}) = {tokens} tokens, torch threads "
        f"{torch.get_num_threads()}, {args.steps} timed steps after {args.warmup} warm-up"
    )
    print("\n1. trainer tokens/s (DeepSpeed step vs plain torch loop, interleaved)")
    print(f"   {'precision':<10}{'deepspeed tok/s':>18}{'plain tok/s':>14}{'ratio':>8}  (median)")
    for label, ds_tps, plain_tps, ratio in throughput(model_config, args, batches):
        mark = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
        print(f"   {label:<10}{ds_tps:>18.1f}{plain_tps:>14.1f}{ratio:>7.2f}x  {mark}")
    print(f"   target: >= {TARGET_RATIO}x")
    if args.skip_publish:
        return
    cost = publish_cost(model_config, args, batches)
    print("\n2. publish cost, publish_every = 1 (ZeRO-1 bf16, lr 1e-5, SeaweedFS on loopback)")
    print(
        f"   step {cost['step_s']:.3f}s  publish {cost['publish_s']:.3f}s  "
        f"fraction {cost['fraction']:.1%}  (target < {TARGET_PUBLISH_FRACTION:.0%}: "
        f"{'ok' if cost['fraction'] < TARGET_PUBLISH_FRACTION else 'ABOVE TARGET'})"
    )
    print(
        f"   delta {cost['delta_bytes'] / 1e6:.2f} MB vs dense bf16 "
        f"{cost['dense_bytes'] / 1e6:.1f} MB ({cost['delta_bytes'] / cost['dense_bytes']:.2%}); "
        f"first base published in {cost['base_s']:.2f}s"
    )


if __name__ == "__main__":
    main()
