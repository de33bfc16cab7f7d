"""Train-inference mismatch: how far the engine's bf16 log-probs are from the trainer's fp32.

Run from the repository root: ``python -m bench.mismatch [--model tiny] [--task ...]``.

Samples ``prompts x group_size`` responses with the CPU engine on a bf16 copy of the model,
scores them again in fp32 with ``core.logprobs.response_logprobs`` (the trainer's and the
stream's function) and prints quantiles of ``|log d|`` per token and of the geometric
mean per sequence, with the share of tokens and sequences each MIS band would mask. The
loss family's default bands were chosen from these figures (``docs/learning.md``).
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import numpy as np

QUANTILES = (0.5, 0.9, 0.99, 0.999, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model spec (core.models)")
    parser.add_argument("--task", default=None, help="default: reverse-3-digits / arithmetic")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    import torch

    from core.logprobs import response_logprobs
    from core.models import EOS_ID, load_model, load_tokenizer, parse_model_spec
    from producers.engine.engine import Engine
    from producers.engine.requests import SamplingParams
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task

    torch.set_num_threads(1)
    tiny = parse_model_spec(args.model).is_tiny
    cache = Path.home() / ".cache" / "rollstream"
    tokenizer = None if tiny else load_tokenizer(args.model, cache_dir=cache)
    task_name = args.task or ("reverse-3-digits" if tiny else "arithmetic")
    task = make_task(task_name, {}, TaskContext(cache_dir=cache, tokenizer=tokenizer))
    eos = [EOS_ID] if tiny else list(task.stop_token_ids)
    engine = Engine(load_model(args.model, "bfloat16"), model_path=args.model, seed=0,
                    eos_token_ids=eos)  # fmt: skip
    rng = random.Random(0)
    prompts = [task.sample(rng) for _ in range(args.prompts)]
    inputs = [p.ids for p in prompts for _ in range(args.group_size)]
    params = SamplingParams(
        max_new_tokens=min(task.max_new_tokens, args.max_new_tokens),
        stop_token_ids=tuple(task.stop_token_ids),
    )
    answered = [
        (i, o) for i, o in zip(inputs, engine.generate(inputs, params), strict=True) if o.output_ids
    ]
    outputs = [o for _, o in answered]
    trainer_side = load_model(args.model, "float32")
    pairs = [(i, o.output_ids) for i, o in answered]
    old = response_logprobs(trainer_side, pairs, torch.float32)
    per_seq = [
        lp - np.asarray(o.output_logprobs, np.float32) for lp, o in zip(old, outputs, strict=True)
    ]
    tokens = np.abs(np.concatenate(per_seq))
    geometric = np.abs(np.array([s.mean() for s in per_seq]))
    print(f"{args.model} on {task_name}: {tokens.size} tokens, {len(per_seq)} sequences, "
          "engine bf16 vs trainer fp32")  # fmt: skip
    print(f"  mean |log d| per token {tokens.mean():.5f}")
    for name, values in (("|log d| per token", tokens), ("|mean log d| per seq", geometric)):
        quantiles = ", ".join(
            f"q{q:g} {v:.5f}"
            for q, v in zip(QUANTILES, np.quantile(values, QUANTILES), strict=True)
        )
        print(f"  {name}: {quantiles}")
    print(f"  tokens outside the token band [0.5, 2]: {np.mean(tokens > np.log(2)):.4f}")
    for bound in (1.001, 1.002, 1.004, 1.01, 1.02):
        share = np.mean(geometric > np.log(bound))
        print(f"  sequences outside the geometric band [1/{bound}, {bound}]: {share:.4f}")


if __name__ == "__main__":
    main()
