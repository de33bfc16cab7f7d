"""The trainer as several data-parallel ranks on one machine, started by torch's launcher:
``python -m torch.distributed.run --nproc-per-node N -m bench.gpu_ranks [--device cuda]``
(``bench.gpu_check`` starts it with two ranks where two GPUs are; NCCL on CUDA, gloo on
the CPU).

Each rank trains its share (``consumers.ranks.split_for_ranks``) of the same synthetic
groups for a few steps, old log-probs being the trainer's own at the step's start (the
stream's exact ones, as ``bench.gpu_roles`` checks). Passed when every step's loss is
finite, the weights moved, and every rank ends with bit-identical weights (the weights'
digest, gathered): the gradients were all-reduced, not trained apart. Rank 0 prints
the report as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist

from consumers.batching import pack
from consumers.batching import response_logprobs as trainer_logprobs
from consumers.config import TrainerConfig
from consumers.ranks import split_for_ranks
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine, shutdown_distributed
from core.devices import resolve_device
from core.models import load_model
from tests.support.synthetic import synthetic_groups
from weights.format import state_digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda.")
    parser.add_argument("--model", default="tiny", help="A model spec (tiny:...).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--response", type=int, default=32, help="Response tokens.")
    args = parser.parse_args()
    device = resolve_device(args.device)
    config = TrainerConfig.model_validate(
        {
            "model": args.model,
            "engine": {"accelerator": device.type, "bf16": args.dtype == "bfloat16", "lr": 1e-3},
        }
    )
    engine = TrainEngine(load_model(config.model.spec, "float32"), config.engine)
    rank, world = dist.get_rank(), dist.get_world_size()
    runner = StepRunner(engine, config, pad_id=0)
    vocab = int(engine.module.config.vocab_size)
    start, losses = state_digest(engine.state_dict()), []
    for step in range(args.steps):
        groups = synthetic_groups(
            2 * world, group_size=4, prompt_len=8, response_len=args.response,
            vocab_size=vocab, seed=step,
        )  # fmt: skip
        mine = split_for_ranks([t for g in groups for t in g], world)[rank]
        with torch.no_grad():
            old = trainer_logprobs(engine.engine, pack(mine), temperature=config.model.temperature)
        attached = [
            t.with_old_logits(old[i, : t.num_response_tokens].cpu().numpy(), "exact")
            for i, t in enumerate(mine)
        ]
        result = runner.train_step([attached], step=step)
        losses.append(float(result.metrics.get("loss/total", float("nan"))))
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, state_digest(engine.state_dict()))
    passed = (
        all(math.isfinite(x) for x in losses) and digests[0] != start and len(set(digests)) == 1
    )
    if rank == 0:
        report = {
            "ranks": world,
            "device": str(device),
            "backend": dist.get_backend(),
            "model": args.model,
            "dtype": args.dtype,
            "losses": losses,
            "weights_moved": digests[0] != start,
            "ranks_bit_identical": len(set(digests)) == 1,
            "passed": passed,
        }
        print(json.dumps({"ranks": report}))
    shutdown_distributed(together=True)
    os._exit(0 if passed else 1)  # skip DeepSpeed's exit hooks in a launcher's child


if __name__ == "__main__":
    main()
